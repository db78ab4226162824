"""A notebook's claims about its own run: printed when the run supports them, refused when not."""
import numpy as np
import pytest

import course_helper as ch
from course_helper.measure import ClaimRefuted, claim, faster


def test_a_supported_claim_prints_its_sentence_and_no_number(capsys):
    line = claim("events beats sequential-pinned", 16.15 < 30.0, "events 16.15 ms, sequential-pinned 30.0 ms")
    assert capsys.readouterr().out == "✓ events beats sequential-pinned\n" == line + "\n"


def test_a_claim_the_run_contradicts_fails_and_names_the_numbers(capsys):
    with pytest.raises(ClaimRefuted, match=r"'events beats streams'.*events 19.43 ms, streams 19.41 ms"):
        claim("events beats streams", 19.43 < 19.41, "events 19.43 ms, streams 19.41 ms")
    assert capsys.readouterr().out == ""
    assert issubclass(ClaimRefuted, AssertionError)        # nbval and pytest count it as a failed check


def test_numpy_comparisons_are_claims_too_and_anything_else_is_refused():
    assert claim("more than half hidden", np.float64(0.9) > 0.5)
    with pytest.raises(ClaimRefuted):
        claim("more than half hidden", np.float64(0.4) > 0.5)
    with pytest.raises(TypeError, match="holds must be True or False"):
        claim("more than half hidden", 0.9)
    with pytest.raises(TypeError, match="sentence"):
        claim("  ", True)


def test_faster_asks_for_a_margin_so_a_tie_is_no_win():
    assert faster(16.15, 30.0)
    assert not faster(19.41, 19.43)                         # 0.1% apart: a tie
    assert not faster(30.0, 16.15)
    assert faster(19.0, 20.0, by=0.04) and not faster(19.0, 20.0, by=0.05)
    with pytest.raises(ValueError, match="share"):
        faster(1.0, 2.0, by=1.5)


def test_the_claims_are_reached_through_ch_measure():
    assert ch.measure.claim is claim and ch.measure.ClaimRefuted is ClaimRefuted
