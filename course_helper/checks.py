"""Argument checks shared by the public API.

Every public function checks its arguments here *before* it allocates memory
or queues work, so a mistake costs nothing and the message says what was
wrong, what is allowed and what to do instead.
"""
from __future__ import annotations

import numbers
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any

#: Share of the available host memory one run may plan to take; the rest is left to the
#: notebook, the browser and the operating system.
HOST_MEMORY_SHARE = 0.8


def positive_int(name: str, value: object, *, minimum: int = 1, hint: str = "") -> int:
    """Return ``value`` as an int, refusing non-integers and values below ``minimum``."""
    # A plain int, the usual case (a loop's step number, every level), skips the test against
    # numbers.Integral, an abstract class: it costs ten times as much.
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be a whole number, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}" + (f"; {hint}" if hint else ""))
    return int(value)


def flag(name: str, value: object) -> bool:
    """Return ``value`` as a bool, refusing anything but True and False.

    A flag taken by truthiness would read ``unsafe="no"`` as yes.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def positive_float(name: str, value: object, *, hint: str = "") -> float:
    """Return ``value`` as a float, refusing non-numbers, NaN, infinities and values <= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number above 0, got {value}" + (f"; {hint}" if hint else ""))
    return value


def one_of(name: str, value: str, choices: Sequence[str]) -> str:
    """Refuse ``value`` unless it is one of ``choices`` (strings)."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(map(repr, choices))}")
    return value


def instance(name: str, value: Any, cls: type | tuple[type, ...], what: str) -> Any:
    """Return ``value``, refusing (TypeError) anything not an instance of ``cls``; ``what`` says
    what is wanted ("a Stream from create_streams()")."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    return value


def shape_tuple(name: str, shape: int | Iterable[int]) -> tuple[int, ...]:
    """Normalise an int or a tuple of ints into a shape tuple of non-negative ints."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tuple of ints, got {shape!r}") from None
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise ValueError(f"{name} must hold non-negative whole numbers, got {shape!r}")
    return tuple(int(s) for s in shape)


def same_layout(dst: Any, src: Any) -> None:
    """A copy needs equal shapes and dtypes and C-contiguous buffers on both sides."""
    # Equal shapes and dtypes, the usual case, are two comparisons; the messages need more work.
    if dst.shape == src.shape and dst.dtype == src.dtype and dst.flags.c_contiguous and src.flags.c_contiguous:
        return
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: destination {tuple(dst.shape)} vs source {tuple(src.shape)}; "
                         "copy into a slice of the same shape (e.g. out[k] for a stack of images)")
    if np.dtype(dst.dtype) != np.dtype(src.dtype):
        raise ValueError(f"dtype mismatch: destination {np.dtype(dst.dtype)} vs source {np.dtype(src.dtype)}; "
                         "allocate both with the same dtype (the course uses float32)")
    for side, arr in (("destination", dst), ("source", src)):
        if not arr.flags.c_contiguous:
            raise ValueError(f"the {side} is not C-contiguous (a strided view); an async copy moves one "
                             "contiguous block - copy whole rows/planes, or make a contiguous buffer first")


def byte_size(n: float) -> str:
    """``n`` bytes in the unit that shows them best: ``"12 B"``, ``"312 KiB"``, ``"1.5 MiB"``,
    ``"2 GiB"`` (never "0 MiB" for a few KiB).

    >>> byte_size(300), byte_size(3 * 2**10), byte_size(1.5 * 2**20), byte_size(2**31)
    ('300 B', '3 KiB', '1.5 MiB', '2 GiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:,.{1 if value < 10 and value != int(value) else 0}f} {unit}"
    return f"{n:,.0f} B"


def host_memory_available() -> int | None:
    """Bytes of host memory available now (None when the operating system does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_memory_shortfall(need: int) -> int | None:
    """None when ``need`` bytes fit in the host memory a run may take, else the bytes available."""
    avail = host_memory_available()
    if avail is not None and need > HOST_MEMORY_SHARE * avail:
        return avail
    return None


def host_memory(need: int, what: str, advice: str | Callable[[int], str], detail: str = "") -> None:
    """Refuse (MemoryError) to go on when ``need`` bytes do not fit in host memory.

    ``what`` names what needs the memory and ``detail`` breaks the bytes down;
    ``advice`` says what to do, or is a function of the available bytes that says it.
    """
    avail = host_memory_shortfall(need)
    if avail is None:
        return
    advice = advice(avail) if callable(advice) else advice
    detail = f" ({detail})" if detail else ""
    raise MemoryError(f"{what} needs {need / 2**20:,.0f} MiB of host memory{detail} but only "
                      f"{avail / 2**20:,.0f} MiB are available; {advice}")
