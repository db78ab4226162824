"""Compression on the GPU (NVIDIA nvCOMP) against compression on the writer threads (Zarr's codecs).

Notebook 11 compresses each chunk on the host, on the writer threads, with Zarr's zstd or
blosc codec. nvCOMP compresses on the GPU before the copy, so it would cut the bytes crossing
PCIe as well as those reaching the disk. This script measures both on the same wavefield levels
(16 levels spread over a 1024² x 320 run, from the nearly empty first ones to the full last
ones), one level at a time as a streamed run would hand them over:

* for each nvCOMP algorithm: the compression ratio, the GPU's compression speed (GB/s of raw
  input, one level per call, and all the levels in one call; the device synchronised after the
  last call), and a round trip check;
* whether Zarr's zstd codec (numcodecs) reads nvCOMP's zstd output written as a raw bitstream
  (the condition for writing GPU-compressed chunks straight into the course's Zarr store);
* the same levels through the writer threads' codecs (single thread, as in ``bench --disk``).

    python -m benchmarks.nvcomp_check --out benchmarks/nvcomp.json

Needs a GPU with CuPy and the ``nvidia-nvcomp-cu13`` wheel (``pip install nvidia-nvcomp-cu13``).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import course_helper as ch
from course_helper import disk
from course_helper.runtime.backend import cupy_module

ALGORITHMS = ("LZ4", "Snappy", "Zstd", "GDeflate", "Deflate", "Cascaded", "Bitcomp", "ANS")


def levels_of_a_run(n=1024, nt=320, count=16):
    """``count`` levels spread over an in-memory run of n² x nt (every level saved)."""
    run = ch.solve(ch.WaveProblem(n0=n, n1=n, nt=nt), "events", trace=False)
    picked = np.linspace(0, nt - 1, count).round().astype(int)
    return picked, [np.ascontiguousarray(run.images[k]) for k in picked]


def gpu_codec(nvcomp, algorithm, chunk_bytes=None, raw=False):
    kwargs = {"algorithm": algorithm}
    if raw:
        kwargs["bitstream_kind"] = nvcomp.BitstreamKind.RAW
    if chunk_bytes is not None:
        kwargs["uncomp_chunk_size"] = chunk_bytes
    return nvcomp.Codec(**kwargs)


def _encode_all(nvcomp, cupy, codec, arrays):
    out = [codec.encode(nvcomp.as_array(a)) for a in arrays]
    cupy.cuda.Device().synchronize()
    return out


def measure_gpu(nvcomp, cupy, algorithm, device_levels, repeats=3):
    """Ratio and GPU compression speed of ``algorithm``, one level per call and all the levels in
    one call (a staging batch), with a decoding round trip."""
    codec = gpu_codec(nvcomp, algorithm)
    batch = [cupy.concatenate([a.ravel() for a in device_levels])]
    raw_bytes = sum(a.nbytes for a in device_levels)
    row = {}
    for label, arrays in (("per_level", device_levels), ("one_batch", batch)):
        encoded = _encode_all(nvcomp, cupy, codec, arrays)           # warm-up (and the sizes)
        size = sum(int(np.asarray(e.cpu()).nbytes) for e in encoded)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            _encode_all(nvcomp, cupy, codec, arrays)
            best = min(best, time.perf_counter() - t0)
        row[label] = {"ratio": raw_bytes / size, "gpu_gbps": raw_bytes / best / 1e9}
    decoded = cupy.asarray(codec.decode(encoded[0]))
    cupy.cuda.Device().synchronize()
    row["round_trip_identical"] = bool(cupy.array_equal(decoded.view(cupy.uint8).ravel(),
                                                        batch[0].view(cupy.uint8).ravel()))
    return row


def zstd_interchange(nvcomp, cupy, host_levels):
    """Whether numcodecs' Zstd (Zarr's zstd codec) decodes nvCOMP's zstd, raw bitstream, one
    chunk per level."""
    import numcodecs
    a = host_levels[-1]
    codec = gpu_codec(nvcomp, "Zstd", chunk_bytes=a.nbytes, raw=True)
    data = np.asarray(_encode_all(nvcomp, cupy, codec, [cupy.asarray(a)])[0].cpu()).tobytes()
    back = np.frombuffer(numcodecs.Zstd().decode(data), np.float32).reshape(a.shape)
    return {"numcodecs_reads_nvcomp_zstd": bool(np.array_equal(back, a)), "bytes": len(data)}


def _in_a_process_of_its_own(what, levels_file):
    """Run one measurement in a fresh process: a CUDA error inside nvCOMP is sticky and would
    spoil every later measurement of this process."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, __file__, "--one", what, "--levels", levels_file],
                       capture_output=True, text=True, timeout=300)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit status {p.returncode}: {tail}"}


def _one(what, levels_file):
    cupy = cupy_module()
    from nvidia import nvcomp
    host_levels = list(np.load(levels_file))
    if what == "interchange":
        return zstd_interchange(nvcomp, cupy, host_levels)
    return measure_gpu(nvcomp, cupy, what, [cupy.asarray(a) for a in host_levels])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--one", help=argparse.SUPPRESS)          # one measurement (a child process)
    parser.add_argument("--levels", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    ch.set_backend("gpu")
    if args.one:
        print(json.dumps(_one(args.one, args.levels)))
        return
    import tempfile
    from nvidia import nvcomp
    picked, host_levels = levels_of_a_run()
    doc = {"device": ch.device_report()["device"], "nvcomp": nvcomp.__version__,
           "levels": [int(k) for k in picked], "level_bytes": host_levels[0].nbytes, "gpu": {}, "host": {}}
    with tempfile.TemporaryDirectory() as tmp:
        levels_file = f"{tmp}/levels.npy"
        np.save(levels_file, np.stack(host_levels))
        for algorithm in ALGORITHMS:
            doc["gpu"][algorithm] = _in_a_process_of_its_own(algorithm, levels_file)
            print(algorithm, doc["gpu"][algorithm], flush=True)
        doc["zstd_interchange"] = _in_a_process_of_its_own("interchange", levels_file)
    print("zstd interchange", doc["zstd_interchange"])
    for codec in ("zstd", "blosc"):
        doc["host"][codec] = disk.codec_speed(np.stack(host_levels), codec)
        print(codec, "(host, one thread)", doc["host"][codec], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
