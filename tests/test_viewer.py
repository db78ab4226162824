import numpy as np
import pytest

import course_helper as ch


@pytest.fixture
def result(small):
    return ch.solve(small, "events", trace=False)


def test_slider_changes_the_displayed_slice_and_title(cpu, result):
    v = ch.plot_slices(result)
    assert v.index == 0 and "level 0" in v.title
    v.slider.value = 30
    assert v.index == 30
    np.testing.assert_array_equal(v.image.get_array(), result.images[30])
    assert "level 30" in v.title and f"{result.times_ms[30]:.2f} ms" in v.title
    assert v.caption.value == v.title
    v.slider.value = 31
    assert not np.array_equal(v.image.get_array(), result.images[30])


def test_play_button_advances_frames(cpu, result):
    v = ch.plot_slices(result)
    for frame in (1, 2, 3):
        v.play.value = frame            # what the Play widget does on each tick
        assert v.index == frame and v.slider.value == frame
        np.testing.assert_array_equal(v.image.get_array(), result.images[frame])


def test_colour_limits_are_symmetric_fixed_and_clipped(cpu, result):
    v = ch.plot_slices(result, clip=0.1)
    lo, hi = v.image.get_clim()
    assert lo == -hi
    assert hi == pytest.approx(0.1 * np.abs(result.images).max())
    v.slider.value = 40
    assert v.image.get_clim() == (lo, hi)
    with pytest.raises(ValueError, match="clip"):
        ch.plot_slices(result, clip=0)


def test_plain_image_stacks_and_bad_stacks(cpu):
    v = ch.plot_slices(np.random.default_rng(1).random((3, 8, 8)))
    assert "slice 0" in v.title
    with pytest.raises(ValueError, match="stack of 2D slices"):
        ch.plot_slices(np.zeros((8, 8)))
    with pytest.raises(IndexError):
        v.show(5)


def test_compare_slices_picks_the_worst_slice(cpu, result):
    import matplotlib.pyplot as plt
    other = result.images.copy()
    other[17] += 1.0
    fig = ch.compare_slices(result, other, labels=("sequential", "broken"))
    assert "level 17" in fig.axes[0].get_title()
    assert "max 1" in fig.axes[2].get_title()
    plt.close(fig)
    with pytest.raises(ValueError, match="differ in shape"):
        ch.compare_slices(result, other[:3])


def test_animate_returns_self_contained_html(cpu, result):
    html = ch.animate(result, step=10)
    assert "<script" in html.data and "level 40" not in html.data[:100]
    with pytest.raises(ValueError):
        ch.animate(result, step=0)
