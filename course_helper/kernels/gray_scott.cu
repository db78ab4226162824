// gray_scott: one explicit Euler step of the Gray-Scott reaction-diffusion system,
//
//   du/dt = Du lap(u) - u v^2 + F (1 - u)
//   dv/dt = Dv lap(v) + u v^2 - (F + k) v
//
// on a periodic N0 x N1 grid (row-major, dimension 1 contiguous), with the 5-point Laplacian
// in grid units. The feed rate F is a field (one value per cell, streamed in from the host);
// the kill rate k is one number. One thread per cell. Every operation is written in the order
// the NumPy version in course_helper/exercises/capstone.py does it, and the kernel is compiled
// with --fmad=false, so that each multiply and each add is rounded on its own, as in NumPy.

extern "C" __global__ void gray_scott(
    const float* __restrict__ u,        // the fields after step n
    const float* __restrict__ v,
    const float* __restrict__ feed,     // F, per cell
    float* __restrict__ u_out,          // the fields after step n + 1 (written)
    float* __restrict__ v_out,
    const int N0, const int N1,
    const float du, const float dv,     // diffusion rates (grid units)
    const float kill,                   // k
    const float dt)
{
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int i = blockIdx.y * blockDim.y + threadIdx.y;
    if (i >= N0 || j >= N1) return;
    const long long row = (long long)i * N1;
    const long long up = (long long)(i == 0 ? N0 - 1 : i - 1) * N1;      // periodic neighbours
    const long long down = (long long)(i == N0 - 1 ? 0 : i + 1) * N1;
    const int left = j == 0 ? N1 - 1 : j - 1;
    const int right = j == N1 - 1 ? 0 : j + 1;

    const float uc = u[row + j], vc = v[row + j], f = feed[row + j];
    const float lap_u = ((u[up + j] + u[down + j]) + (u[row + left] + u[row + right])) - 4.0f * uc;
    const float lap_v = ((v[up + j] + v[down + j]) + (v[row + left] + v[row + right])) - 4.0f * vc;
    const float uvv = (uc * vc) * vc;
    u_out[row + j] = uc + dt * ((du * lap_u - uvv) + f * (1.0f - uc));
    v_out[row + j] = vc + dt * ((dv * lap_v + uvv) - (f + kill) * vc);
}
