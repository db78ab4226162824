"""Claims a notebook makes about its own run, checked against that run.

A sentence such as "the events loop beats sequential-pinned" is true on the run it was written
beside and may be false on the next GPU, or the next day. The notebooks therefore state each such
comparison in a cell that checks it: ``claim(sentence, holds, evidence)`` prints the sentence when
the run's numbers support it and raises :class:`ClaimRefuted`, naming the numbers, when they do
not. Under ``pytest --nbval`` the raised error fails the notebook, so a stored run can never sit
beside a sentence it contradicts. The printed line holds no number, so nbval compares it as it
stands; the numbers behind it are printed by the cells that measured them.

A claim too thin for the machine's noise is not made: :func:`faster` asks for a margin.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ClaimRefuted", "claim", "faster"]

#: What a supported claim's line starts with.
HOLDS = "✓ "


class ClaimRefuted(AssertionError):
    """A sentence of the lesson that this run's numbers contradict (an AssertionError: nbval and
    pytest report it as a failed check)."""


def claim(sentence: str, holds: bool, evidence: str = "") -> str:
    """Print ``sentence`` if ``holds``; otherwise raise :class:`ClaimRefuted` with ``evidence``.

    ``holds`` is the comparison the sentence makes, computed from the run (``events_ms <
    pinned_ms``); ``evidence`` is what a reader needs to see why it failed (the numbers, with
    units). Returns the printed line.
    """
    if not isinstance(sentence, str) or not sentence.strip():
        raise TypeError(f"sentence must be the claim's text, got {sentence!r}")
    if not isinstance(holds, (bool, np.bool_)):          # a comparison of NumPy numbers gives np.bool_
        raise TypeError(f"holds must be True or False (the claim's comparison), got {holds!r} "
                        f"({type(holds).__name__})")
    if not holds:
        raise ClaimRefuted(f"this run does not support the lesson's sentence {sentence!r}"
                           + (f": {evidence}" if evidence else "")
                           + ". The text beside it needs changing, or the run repeating on a quieter machine.")
    line = HOLDS + sentence
    print(line)
    return line


def faster(a_ms: float, b_ms: float, *, by: float = 0.05) -> bool:
    """Whether a time ``a_ms`` beats ``b_ms`` by more than the share ``by`` of ``b_ms`` (0.05: 5%).

    The margin keeps a claim out of the noise: two loops within a few percent of each other are
    said to tie, not to beat one another.
    """
    if not 0 <= by < 1:
        raise ValueError(f"by must be a share of the slower time, from 0 up to below 1, got {by}")
    return a_ms < (1 - by) * b_ms
