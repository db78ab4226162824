"""Reading a store into xarray through the run's record (``open_store(path).to_xarray()``): the
same Dataset as ``xarray.open_zarr``, but a chunk file out of its place, emptied or deleted is
refused when its levels are read, where plain xarray hands over the wrong levels or NaN."""
import pathlib
import re

import nbformat
import numpy as np
import pytest

import course_helper as ch
from course_helper import disk

xr = pytest.importorskip("xarray")


@pytest.fixture(autouse=True)
def _cpu():
    ch.set_backend("cpu")


@pytest.fixture(params=[None, "gpu-zstd"], ids=["raw", "gpu-zstd"])
def compress(request):
    return request.param


def _run(path, compress, source=None):
    """A finished store of 15 levels in chunk files of 3 levels (shards, for gpu-zstd); its levels."""
    return ch.solve(ch.WaveProblem(n0=48, n1=40, nt=30, source=source), "staged", trace=False, store=path,
                    every=2, batch=3, compress=compress).images[:]


@pytest.fixture
def store(compress, tmp_path):
    """A finished store (:func:`_run`) and its levels."""
    path = tmp_path / "s.zarr"
    return path, _run(path, compress)


def _swap(a, b):
    tmp = a.with_name("swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_a_clean_store_reads_as_open_store_and_as_plain_xarray(store):
    path, ref = store
    run = disk.open_store(path)
    ds, plain = run.to_xarray(), xr.open_zarr(path)
    assert isinstance(ds, xr.Dataset) and ds["u"].dims == ("time", "x0", "x1")
    assert np.array_equal(ds["u"].values, run.images[:]) and np.array_equal(ds["u"].values, ref)
    assert np.array_equal(ds["u"].isel(time=7, x0=slice(3, 9)).values, run.images[7, 3:9])
    assert np.array_equal(ds["u"].isel(time=slice(None, None, -2)).values, ref[::-2])
    for name in ("time", "level", "x0", "x1", "peak"):
        assert np.array_equal(ds[name].values, plain[name].values)
    assert ds["complete"].values.tolist() == run.complete.tolist() == [True] * 15
    assert ds.attrs == plain.attrs


@pytest.mark.parametrize("damage", ["swapped", "moved", "foreign", "emptied", "deleted"])
def test_a_damaged_chunk_file_is_refused_where_plain_xarray_hands_over_wrong_levels(store, compress, damage,
                                                                                     tmp_path):
    path, ref = store
    u = path / "u"
    if damage == "swapped":
        _swap(u / "c.1.0.0", u / "c.3.0.0")
    elif damage == "moved":                  # c.0's file moved into c.1's place
        (u / "c.1.0.0").unlink()
        (u / "c.0.0.0").rename(u / "c.1.0.0")
    elif damage == "foreign":                # the same place's file of another run of the same shape
        _run(tmp_path / "other.zarr", compress, source=(12, 10))
        (u / "c.1.0.0").write_bytes((tmp_path / "other.zarr" / "u" / "c.1.0.0").read_bytes())
    elif damage == "emptied":
        (u / "c.1.0.0").write_bytes(b"")
    else:
        (u / "c.1.0.0").unlink()
    if damage != "emptied":                  # plain xarray, unchecked: the wrong levels, or NaN
        wrong = xr.open_zarr(path)["u"].isel(time=4).values
        assert not np.array_equal(wrong, ref[4])
    ds = disk.open_store(path).to_xarray()
    says = "is gone" if damage == "deleted" else "is not the one this run wrote there"
    with pytest.raises(disk.StoreDamaged, match=rf"c\.1\.0\.0 \(levels 6\.\.10\) {says}"):
        ds["u"].isel(time=4).load()
    with pytest.raises(disk.StoreDamaged):
        ds["u"].load()
    assert np.array_equal(ds["u"].isel(time=slice(6, 9)).values, ref[6:9])      # the chunk files in place
    assert np.array_equal(ds["u"].isel(time=[12, 13]).values, ref[12:14])


def test_each_read_checks_the_chunk_files_as_they_are_then(store):
    """Lazy: the check is made when the levels are handed over, not only when the store was opened."""
    path, ref = store
    ds = disk.open_store(path).to_xarray()
    assert np.array_equal(ds["u"].isel(time=4).values, ref[4])
    _swap(path / "u" / "c.1.0.0", path / "u" / "c.3.0.0")
    with pytest.raises(disk.StoreDamaged, match=r"c\.1\.0\.0 .* not the one this run wrote there"):
        ds["u"].isel(time=4).load()


def test_levels_an_interrupted_run_never_wrote_read_as_nan_and_are_not_complete(tmp_path):
    path = tmp_path / "s.zarr"
    ch.solve(ch.WaveProblem(n0=48, n1=40, nt=30), "staged", trace=False, store=path, every=2, batch=3)
    (path / "u" / "c.4.0.0").unlink()
    flags = ch.disk.layout.zarr_module().open_array(str(path / "complete"), mode="r+")
    flags[12:] = False                          # as if the run had stopped before writing them
    run = disk.open_store(path)
    ds = run.to_xarray()
    assert np.isnan(ds["u"].isel(time=13).values).all()
    assert ds["complete"].values.tolist() == run.complete.tolist() == [True] * 12 + [False] * 3


def test_the_docs_say_plain_xarray_does_not_verify_and_point_to_to_xarray():
    """Where a reader looks for xarray: docs/disk.md, the package's page and notebook 11's reading."""
    root = pathlib.Path(__file__).resolve().parents[2]
    nb11 = nbformat.read(root / "notebooks" / "11_streaming_to_disk.ipynb", as_version=4)
    reading = [c.source for c in nb11.cells if c.cell_type == "markdown" and "Reading it back" in c.source]
    places = {"docs/disk.md": (root / "docs" / "disk.md").read_text(),
              "docs/helper-package.md": (root / "docs" / "helper-package.md").read_text(),
              "notebook 11, 11.8": "".join(reading)}
    for where, text in places.items():
        text = " ".join(text.replace("*", "").split())
        assert re.search(r"open_zarr[^.]{0,80}(does not|doesn't) verify", text), where
        assert "open_store(path).to_xarray()" in text, where
