"""Compression on the device (compress="gpu-zstd"): a store of Zarr shards that any Zarr reader
opens, compressed on the device on a stream of its own (nvCOMP on a GPU, the modelled engine on
the CPU backend, the writer threads where neither is here), bit-identical to the in-memory run.
What the store promises with compression on (kills, Ctrl-C, full disks, damage) is tested with
the other layouts in tests/disk/test_store.py."""
import json
import re
import warnings

import numpy as np
import pytest

import course_helper as ch
from course_helper import disk, memory
from course_helper.disk import compression, layout, shards
from course_helper.runtime import profiles
from course_helper.runtime.base import Runtime
from course_helper.runtime.scheduler import ticks
from course_helper.timelines.timeline import intersection_length, merge_intervals


@pytest.fixture(autouse=True)
def _cpu():
    ch.set_backend("cpu")


@pytest.fixture
def nvcomp_failing(monkeypatch):
    """``nvcomp_failing(error)``: nvCOMP's package raises ``error`` when imported; the answer of
    :func:`compression.nvcomp_unusable` (kept for the process) is forgotten before and after."""
    def arm(error):
        def failing():
            raise error
        monkeypatch.setattr(compression, "nvcomp_module", failing)
        compression.nvcomp_unusable.cache_clear()

    yield arm
    compression.nvcomp_unusable.cache_clear()


def _problem(nt=40):
    return ch.WaveProblem(n0=48, n1=40, nt=nt)


def _index(path, inner):
    """A shard file's index: (offset, nbytes) of each inner chunk."""
    data = path.read_bytes()
    return np.frombuffer(data[-(16 * inner + 4):-4], "<u8").reshape(inner, 2), data


def test_a_gpu_zstd_store_holds_zarrs_own_zstd_chunks_in_shards_that_xarray_reads(tmp_path):
    """Each inner chunk is byte for byte what Zarr's own zstd and crc32c codecs make of it, the
    shard's index says where it is, and Zarr and xarray read the store with no course code."""
    xr = pytest.importorskip("xarray")
    zarr = layout.zarr_module()
    p = ch.WaveProblem(n0=64, n1=32, nt=30)
    ref = ch.solve(p, "staged", every=2, trace=False).images
    ch.solve(p, "staged", every=2, trace=False, store=tmp_path / "g.zarr", batch=4, compress="gpu-zstd")
    u = zarr.open_array(str(tmp_path / "g.zarr" / "u"), mode="r")
    rows = shards.inner_rows(64, 32)
    assert u.shards == (4, 64, 32) and u.chunks == (1, rows, 32) and rows * 32 * 4 <= shards.INNER_CHUNK_BYTES
    assert np.array_equal(u[:], ref)
    ds = xr.open_zarr(tmp_path / "g.zarr")
    assert np.array_equal(ds["u"].values, ref) and np.allclose(ds["time"].values, np.arange(0, 30, 2) * p.dt)
    twin = zarr.create_array(str(tmp_path / "twin.zarr"), shape=u.shape, chunks=u.chunks, shards=u.shards,
                             dtype="float32", fill_value=np.nan, compressors=u.compressors,
                             chunk_key_encoding={"name": "default", "separator": "."})
    twin[:] = ref
    per_level = 64 // rows
    for k in (0, 3):                                  # a whole shard, and the last one (3 of its 4 levels)
        mine, mine_bytes = _index(tmp_path / "g.zarr" / "u" / f"c.{k}.0.0", 4 * per_level)
        theirs, their_bytes = _index(tmp_path / "twin.zarr" / f"c.{k}.0.0", 4 * per_level)
        present = mine[:, 0] != shards.EMPTY
        assert present.sum() == min(4, 15 - 4 * k) * per_level          # levels past the end are left out
        assert np.array_equal(present, theirs[:, 0] != shards.EMPTY)
        for (a, n), (b, m) in zip(mine[present], theirs[present]):
            assert mine_bytes[a:a + n] == their_bytes[b:b + m]


def test_the_host_writes_the_same_store_where_the_device_cannot_compress_and_says_why(tmp_path):
    """With a profile that measured no compression on the device (the H100's), the writer threads
    compress the chunks, with a warning naming the reason; the files are the same bytes."""
    p = _problem()
    modelled = ch.solve(p, "staged", trace=False, store=tmp_path / "m.zarr", batch=4, compress="gpu-zstd")
    assert modelled.compression["where"] == "modelled"
    ch.set_backend("cpu", profile="h100")
    with pytest.warns(disk.CompressionFallback, match="no measured compression on the device.*H100") as caught:
        host = ch.solve(p, "staged", trace=False, store=tmp_path / "h.zarr", batch=4, compress="gpu-zstd")
    assert "writer threads compress the chunks on the host" in str(caught[0].message)
    assert host.compression["where"] == "host" and "busy_ms" not in host.compression
    for k in range(10):
        name = f"u/c.{k}.0.0"
        assert (tmp_path / "m.zarr" / name).read_bytes() == (tmp_path / "h.zarr" / name).read_bytes()


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'nvidia.nvcomp'"),
                                   ImportError("libnvcomp.so.6: cannot open shared object file: No such file")],
                         ids=["no package", "no library"])
def test_without_nvcomp_on_a_gpu_the_host_compresses_and_says_how_to_install_it(monkeypatch, nvcomp_failing, error):
    """engine_for on a GPU runtime whose nvCOMP does not import, or whose package imports without
    its library: the host path, the error and the extra named."""
    class Gpu:
        device_label = "a GPU"
        compresses_on_device = Runtime.compresses_on_device    # a GPU's answer (None): nvCOMP decides

    monkeypatch.setattr(compression.runtime, "get", lambda: Gpu())
    nvcomp_failing(error)
    with pytest.warns(disk.CompressionFallback, match=r"nvCOMP cannot be loaded .*\[nvcomp\]") as said:
        assert compression.engine_for("gpu-zstd")[0] == "host"
    assert str(error) in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # the host codecs are never a fallback
        assert compression.engine_for("zstd") == ("host", "")


def test_nvcomp_counts_as_usable_only_once_its_library_has_loaded_and_is_tried_once(monkeypatch, nvcomp_failing):
    class Package:                         # nvCOMP's package; its library loads with the first codec
        tries = 0
        library = None                     # the error loading the library raises, or None: it loads

        def Codec(self, **kwargs):         # noqa: N802 - nvCOMP's name
            Package.tries += 1
            if self.library:
                raise self.library

    monkeypatch.setattr(compression, "nvcomp_module", Package)
    compression.nvcomp_unusable.cache_clear()
    assert compression.nvcomp_unusable() is None and compression.nvcomp_unusable() is None
    assert Package.tries == 1                                  # tried once, then remembered
    Package.library = ImportError("libnvcomp.so.6: cannot open shared object file")
    compression.nvcomp_unusable.cache_clear()
    why = compression.nvcomp_unusable()
    assert "libnvcomp.so.6" in why and compression.NVCOMP_EXTRA in why
    nvcomp_failing(ModuleNotFoundError("No module named 'nvidia.nvcomp'"))
    assert "No module named 'nvidia.nvcomp'" in compression.nvcomp_unusable()


def test_the_modelled_timeline_shows_compression_under_compute_and_writes_under_both(tmp_path):
    p = ch.WaveProblem(n0=256, n1=256, nt=320)
    r = ch.solve(p, "staged", store=tmp_path / "t.zarr", batch=16, compress="gpu-zstd")
    trace = r.trace
    kernels = trace.of_kind("kernel")
    compute = merge_intervals((e.start_ms, e.end_ms) for e in kernels if e.track == "compute")
    compressing = merge_intervals((e.start_ms, e.end_ms) for e in trace.of_kind("compress"))
    assert all(e.track == "compress" for e in trace.of_kind("compress"))
    assert not [e for e in kernels if e.track == "compress"]         # compression is not drawn as a kernel
    writing = merge_intervals((e.start_ms, e.end_ms) for e in trace.of_kind("disk write"))
    assert len(compressing) and intersection_length(compressing, compute) > 0        # compression under compute
    assert intersection_length(writing, compute) > 0 and intersection_length(writing, compressing) > 0
    copies = trace.of_kind("D2H")
    raw = len(r.levels) * p.nbytes_level
    assert {e.track for e in copies} == {"compress"} and len(copies) == len(r.levels) // 16
    assert sum(e.bytes for e in copies) == r.compression["compressed_bytes"] < raw / 1.5   # fewer bytes cross
    assert {e.kind for e in trace.events if e.track.startswith("io")} == {"D2D"}          # the raw levels stay


def test_a_modelled_compression_takes_the_profiles_latency_plus_bytes_over_its_bandwidth(tmp_path):
    p = ch.WaveProblem(n0=128, n1=128, nt=64)
    r = ch.solve(p, "staged", store=tmp_path / "c.zarr", batch=8, compress="gpu-zstd")
    spec = ch.runtime.get().profile["compress"]["zstd"]
    chunk_ms = spec["latency_us"] * 1e-3 + 8 * p.nbytes_level / (spec["gbps"] * 1e6)
    calls = [e for e in r.trace.of_kind("compress") if e.track == "compress"]
    assert len(calls) == 8 and all(e.duration_ms == pytest.approx(ticks(chunk_ms), abs=1e-6) for e in calls)
    summary = r.compression
    assert summary["chunks"] == 8 and summary["raw_bytes"] == 64 * p.nbytes_level
    assert summary["gbps"] == pytest.approx(8 * p.nbytes_level / chunk_ms / 1e6, rel=1e-4)
    assert r.elapsed_ms >= 8 * chunk_ms                              # one chunk at a time on the engine


def test_a_loops_copy_into_a_device_slot_stays_on_the_device(tmp_path):
    """copy_to_host_async and copy_to_host into a ring slot on the device queue a device-to-device
    copy on the loop's stream and hand the slot to the sink; the blocking one waits for it."""
    sink = disk.DiskSink(tmp_path / "s.zarr", _problem(nt=8), 1, 1, compress="gpu-zstd")
    seen = []

    class Ops:
        def op_queued(self, op):
            seen.append((op.kind, op.stream.name))

    watcher = ch.runtime.observe.add(Ops())
    try:
        src = memory.device_zeros((48, 40))
        stream = ch.create_streams(1, name="io")[0]
        slot = sink.ring[0]
        assert isinstance(slot, disk.sink.DeviceSlot) and slot.shape == (48, 40)
        memory.copy_to_host_async(slot, src, stream, level=0)
        memory.copy_to_host(sink.ring[1], src + 1, level=1)
        assert [kind for kind, _ in seen] == ["D2D", "D2D"] and seen[0][1] == "io"
        with pytest.raises(ValueError, match="shape"):
            memory.copy_to_host_async(sink.ring[2], memory.device_zeros((4, 4)), stream, level=2)
        ch.synchronize()
    finally:
        ch.runtime.observe.remove(watcher)
        sink.finish()
    stored = disk.open_store(tmp_path / "s.zarr")
    assert stored.complete.tolist()[:2] == [True, True] and (stored.images[1] == 1).all()


def test_a_profile_with_bad_compression_figures_is_refused_naming_the_field():
    doc = profiles.load("h200")
    profiles.validate(json.loads(json.dumps(doc)))
    doc["compress"]["zstd"]["gbps"] = -1
    with pytest.raises(ValueError, match=r"compress\.zstd\.gbps"):
        profiles.validate(doc)
    doc["compress"] = {"note": "not measured here"}
    profiles.validate(doc)                                    # a note alone: no compression on the device


def test_cli_run_compresses_on_the_modelled_gpu(tmp_path, capsys):
    from course_helper import cli
    path = tmp_path / "cli.zarr"
    assert cli.main(["run", "--store", str(path), "--n", "48", "--nt", "30", "--strategy", "staged", "--batch", "6",
                     "--compress", "gpu-zstd", "--backend", "cpu", "--no-progress"]) == 0
    assert "on the modelled GPU, 30 levels complete" in capsys.readouterr().out
    ref = ch.solve(ch.WaveProblem(n0=48, n1=48, nt=30), "staged", trace=False)
    assert np.array_equal(disk.open_store(path).images[:], ref.images)


def test_a_batch_beyond_the_run_s_levels_is_capped_once_with_a_note(tmp_path, capsys):
    """--batch 100000 on a 20-level run sized a shard (and staging buffers) for 100,000 levels, and
    the ratio it reported counted them: capped at the run's saved levels, it is the run of batch 20."""
    from course_helper import cli
    ratios = {}
    for batch in ("100000", "20"):
        path = tmp_path / f"b{batch}.zarr"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli.main(["run", "--store", str(path), "--n", "48", "--nt", "20", "--strategy", "staged",
                             "--batch", batch, "--compress", "gpu-zstd", "--backend", "cpu", "--no-progress"]) == 0
        notes = [str(w.message) for w in caught if "capped" in str(w.message)]
        assert notes == (["batch=100000 is more than the run's 20 saved levels: it is capped at 20 (one staging "
                          "batch, one chunk of a store, holds them all)"] if batch == "100000" else [])
        ratios[batch] = re.search(r"compression ratio ([0-9.]+)", capsys.readouterr().out).group(1)
        stored = disk.open_store(path)
        assert stored.images.file_levels == 20 and stored.complete.all()
    assert ratios["100000"] == ratios["20"] and float(ratios["20"]) > 1
    p = ch.WaveProblem(n0=48, n1=40, nt=20)
    with pytest.warns(UserWarning, match="capped at 10"):
        assert ch.solve(p, "staged", every=2, batch=11, trace=False).batch == 10
    with pytest.warns(UserWarning, match="capped at 20"):
        assert ch.solver.plan_memory(p, "staged", batch=10**6) == ch.solver.plan_memory(p, "staged", batch=20)


def test_a_store_s_chunk_beyond_the_run_s_levels_is_capped_by_the_sink_itself(tmp_path):
    """DiskSink, the store's writer that solve uses, sizes no chunk file (no shard) beyond the run."""
    p = ch.WaveProblem(n0=48, n1=40, nt=20)
    with pytest.warns(UserWarning, match=r"chunk=100000 is more than the run's 20 saved levels: it is capped at 20"):
        sink = disk.DiskSink(tmp_path / "s.zarr", p, 1, chunk=100000, compress="gpu-zstd")
    try:
        assert sink.chunk == 20 and sink.data.shards == (20, 48, 40)
    finally:
        sink.finish()
    for wrong, error in ((0, ValueError), (2.5, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="chunk must be"):
            disk.DiskSink(tmp_path / f"w{wrong}.zarr", p, 1, chunk=wrong)


# --------------------------------------------------------------------------
# On a GPU with nvCOMP (the nvcomp extra)
# --------------------------------------------------------------------------
def _gpu_with_nvcomp():
    if not ch.runtime.gpu_available():
        pytest.skip("no working CUDA GPU here (the GPU tests run on a GPU machine)")
    unusable = compression.nvcomp_unusable()
    if unusable:
        pytest.skip(unusable)
    ch.set_backend("gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("strategy, batch", [("events", None), ("staged", 4), ("sequential", None)])
def test_on_a_gpu_nvcomp_compresses_a_store_bit_identical_to_memory(tmp_path, strategy, batch):
    _gpu_with_nvcomp()
    p = ch.WaveProblem(n0=64, n1=48, nt=40)
    ref = ch.solve(p, strategy, every=2, trace=False).images
    r = ch.solve(p, strategy, every=2, store=tmp_path / "g.zarr", batch=batch, compress="gpu-zstd")
    assert r.compression["where"] == "device" and r.compression["chunks"] == len(r.levels) // (batch or 1) + (
        len(r.levels) % (batch or 1) > 0)
    stored = disk.open_store(tmp_path / "g.zarr")
    assert stored.complete.all() and np.array_equal(stored.images[:], ref)
    assert np.array_equal(stored.group["peak"][:], np.abs(ref).max(axis=(1, 2)))
    xr = pytest.importorskip("xarray")
    assert np.array_equal(xr.open_zarr(tmp_path / "g.zarr")["u"].values, ref)
    compress = [e for e in r.trace.events if e.track == "compress"]
    assert {e.kind for e in compress} == {"compress", "D2H"} and all(e.end_ms >= e.start_ms for e in compress)
    assert not [e for e in r.trace.of_kind("D2H") if e.track != "compress"]     # no raw level crossed


@pytest.mark.gpu
def test_on_a_gpu_nvcomp_and_the_host_write_stores_that_read_the_same(tmp_path, nvcomp_failing):
    """Where nvCOMP is missing on a GPU, the writer threads compress: a warning, the same levels."""
    _gpu_with_nvcomp()
    p = ch.WaveProblem(n0=64, n1=48, nt=30)
    ch.solve(p, "staged", trace=False, store=tmp_path / "d.zarr", batch=4, compress="gpu-zstd")
    nvcomp_failing(ModuleNotFoundError("No module named 'nvidia.nvcomp'"))
    with pytest.warns(disk.CompressionFallback, match="nvCOMP cannot be loaded"):
        r = ch.solve(p, "staged", trace=False, store=tmp_path / "h.zarr", batch=4, compress="gpu-zstd")
    assert r.compression["where"] == "host"
    host, device = (disk.open_store(tmp_path / name).images[:] for name in ("h.zarr", "d.zarr"))
    assert np.array_equal(host, device)


@pytest.mark.gpu
def test_on_a_gpu_a_failing_nvcomp_call_stops_the_run_and_flags_only_written_levels(tmp_path, monkeypatch):
    _gpu_with_nvcomp()
    p = ch.WaveProblem(n0=64, n1=48, nt=60)
    ref = ch.solve(p, "events", trace=False).images
    real, calls = compression.NvcompCompressor.compress, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("nvCOMP failed (simulated)")
        return real(self, *args)

    monkeypatch.setattr(compression.NvcompCompressor, "compress", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        ch.solve(p, "events", trace=False, store=tmp_path / "f.zarr", compress="gpu-zstd")
    stored = disk.open_store(tmp_path / "f.zarr")
    assert stored.state == "failed" and 0 < stored.complete.sum() < len(ref) and not stored.complete[9]
    assert np.array_equal(stored.images[np.flatnonzero(stored.complete)], ref[stored.complete])


@pytest.mark.gpu
def test_on_a_gpu_the_packing_kernel_lays_out_each_inner_chunk_with_its_crc32c():
    """The device packs the compressed inner chunks one after the other, each followed by the
    CRC32C that Zarr's crc32c codec checks (as google-crc32c computes it), whatever its length."""
    if not ch.runtime.gpu_available():
        pytest.skip("no working CUDA GPU here (the GPU tests run on a GPU machine)")
    ch.set_backend("gpu")
    cupy = ch.runtime.backend.cupy_module()
    sizes = np.array([1, 3, 4, 5, 255, 1000, 4097, 65536], np.uint64)
    cap = 65536 + 16
    src = np.random.default_rng(7).integers(0, 256, len(sizes) * cap, dtype=np.uint8)
    to = np.cumsum(sizes + 4) - (sizes + 4)
    dst, crcs = cupy.zeros(int((sizes + 4).sum()), cupy.uint8), cupy.zeros(len(sizes), cupy.uint32)
    frm = np.arange(len(sizes), dtype=np.uint64) * np.uint64(cap)
    compression._pack_kernel(cupy)((len(sizes),), (256,), (cupy.asarray(src), dst, cupy.asarray(frm), cupy.asarray(to),
                                                          cupy.asarray(sizes), crcs))
    pieces = [src[int(f):int(f) + int(z)].tobytes() for f, z in zip(frm, sizes)]
    assert dst.get().tobytes() == b"".join(p + shards.checksum(p) for p in pieces)
    assert crcs.get().tobytes() == b"".join(shards.checksum(p) for p in pieces)


@pytest.mark.gpu
def test_on_a_gpu_the_memory_check_counts_the_compression_buffers(tmp_path, monkeypatch):
    """Before it allocates, the store asks for its ring and nvCOMP's three chunk-sized buffers: where
    the ring alone would fit, the run is refused with a message that names them."""
    _gpu_with_nvcomp()
    p, batch = ch.WaveProblem(n0=256, n1=256, nt=64), 8
    ring = disk.ring_slots() * batch * p.nbytes_level
    rt = ch.runtime.get()
    monkeypatch.setattr(type(rt), "device_free_bytes", lambda self: int(ring / 0.8))   # the ring alone fits
    with pytest.raises(MemoryError, match="compression's three buffers"):
        ch.solve(p, "staged", trace=False, store=tmp_path / "m.zarr", batch=batch, compress="gpu-zstd")
