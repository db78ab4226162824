"""A store as an ``xarray.Dataset`` whose wavefield is checked against its run's record when it is read.

``xarray.open_zarr(path)`` reads a course store with no course code, checking each chunk's own
CRC32C: a chunk file moved to another place, or copied in from another run of the same shape, passes
that check, and xarray hands its levels over as the wrong ones; a deleted chunk file reads as NaN.
:func:`verified_dataset` (``open_store(path).to_xarray()``) gives the same Dataset, with ``u`` read
lazily through a backend array that first checks the chunk files each read touches
(:meth:`~.reading.StoredRun.verify_levels`) and then reads them through :class:`~.reading.StoredImages`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .layout import DATA, durable_store

if TYPE_CHECKING:
    from .reading import StoredRun

__all__ = ["verified_dataset"]


def _verified_array(run: StoredRun) -> Any:
    """``u`` of ``run`` as an xarray backend array: each read checks its chunk files first."""
    import xarray as xr
    from xarray.core import indexing          # the lazy indexing xarray's own backends use

    class VerifiedWavefield(xr.backends.BackendArray):
        def __init__(self):
            self.shape, self.dtype = run.images.shape, run.images.dtype

        def __getitem__(self, key):
            # BASIC: xarray hands over integers and slices only, and does the rest itself.
            return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.BASIC, self._read)

        def _read(self, key):
            run.verify_levels(np.arange(self.shape[0])[key[0]])
            return np.asarray(run.images[key])

    return indexing.LazilyIndexedArray(VerifiedWavefield())


def verified_dataset(run: StoredRun) -> Any:
    """The store of ``run`` as ``xarray.open_zarr`` opens it, with ``u`` read through the run's
    record (see the module's text) and ``complete`` the run's own (:attr:`~.reading.StoredRun.complete`)."""
    import xarray as xr
    plain = xr.open_zarr(durable_store(run.path, read_only=True), chunks=None)
    u = plain[DATA].variable
    verified = xr.Variable(u.dims, _verified_array(run), u.attrs, u.encoding)
    return plain.assign({DATA: verified, "complete": (plain["complete"].dims, run.complete.copy(),
                                                       plain["complete"].attrs)})
