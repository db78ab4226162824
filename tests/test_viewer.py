import numpy as np
import pytest

import course_helper as ch
from course_helper.viewer import colour_limit


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


def test_slider_set_in_code_is_the_value_every_widget_holds(cpu, result):
    # The play button holds the slider's value in the kernel too, so no browser-side link has a
    # stale value to send back (a late play update once reset the slider after Run All).
    v = ch.plot_slices(result)
    v.slider.value = 30
    v.slider.value = 40
    assert v.play.value == 40
    v.play.value = 40                   # the browser's echo of the current value changes nothing
    assert v.slider.value == 40 and v.index == 40


def test_stored_widget_output_carries_a_picture_of_its_slice(cpu, result):
    v = ch.plot_slices(result)
    v.slider.value = 20
    bundle = v._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["image/png"].startswith(b"\x89PNG") and bundle["image/png"] == v.png()
    v.slider.value = 21
    assert v.png() != bundle["image/png"], "the picture shows the current slice"


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


def test_animate_returns_an_animated_gif_and_a_still_strip(cpu, result):
    import io

    from PIL import Image
    anim = ch.animate(result, step=10, interval=80)
    # Plain images, which show in an untrusted notebook: no HTML, no script, nothing fetched.
    assert anim.data == anim.gif and anim.gif.startswith(b"GIF89a")
    assert anim.strip.startswith(b"\x89PNG")
    gif = Image.open(io.BytesIO(anim.gif))
    assert gif.n_frames == len(anim.levels) and gif.info["loop"] == 0 and gif.info["duration"] == 80
    pictures = []
    for k in range(gif.n_frames):
        gif.seek(k)
        pictures.append(np.asarray(gif.convert("RGB")))
    assert all((a != b).any() for a, b in zip(pictures, pictures[1:])), "two frames in a row are the same"
    # The first frame is not the silent box the run starts from, and every 10th level follows.
    first = list(result.levels).index(anim.levels[0])
    assert np.abs(result.images[first]).max() >= colour_limit(result.images)
    assert np.abs(result.images[:first]).max() < colour_limit(result.images)
    assert np.diff(anim.levels).tolist() == [10] * (len(anim.levels) - 1)
    with pytest.raises(ValueError):
        ch.animate(result, step=0)


def test_a_concentration_gets_a_sequential_scale_from_zero_with_its_own_label(cpu):
    """The capstone's Gray-Scott v is never negative: no blue half of a diverging map, and the colour
    bar says what the colours are."""
    rng = np.random.default_rng(2)
    v = ch.plot_slices(rng.random((3, 8, 8)) * 0.4, clip=1.0, title="v", scale="sequential",
                       label="concentration v")
    lo, hi = v.image.get_clim()
    assert lo == 0 and hi == pytest.approx(v.vlim) and v.image.get_cmap().name == ch.viewer.SCALES["sequential"]
    assert v.colorbar.ax.get_ylabel() == "concentration v"
    wave = ch.plot_slices(rng.standard_normal((3, 8, 8)))                 # the default: the wave's scale
    assert wave.image.get_clim()[0] == -wave.image.get_clim()[1]
    assert wave.image.get_cmap().name == "seismic" and wave.colorbar.ax.get_ylabel() == "amplitude"
    with pytest.raises(ValueError, match="scale must be one of 'symmetric', 'sequential', got 'log'"):
        ch.plot_slices(rng.random((3, 8, 8)), scale="log")
    with pytest.raises(ValueError, match="go down to -.*use scale='symmetric'"):
        ch.plot_slices(rng.standard_normal((3, 8, 8)), scale="sequential")


def test_each_source_gives_its_own_levels_and_times(cpu, tmp_path):
    """A Result, a store (opened or by path) and a store's images bring their level numbers; a
    Result and a store their times too; a plain stack is numbered from 0 and has none."""
    p = ch.WaveProblem(24, 24, nt=8)
    run = ch.solve(p, "events", every=2, trace=False, store=tmp_path / "s.zarr")
    stored = ch.disk.open_store(tmp_path / "s.zarr")
    for source in (run, stored, str(tmp_path / "s.zarr")):
        images, levels, times = ch.viewer._stack_of(source)
        assert list(levels) == [0, 2, 4, 6] and len(times) == 4 and images.shape == (4, 24, 24)
    _, levels, times = ch.viewer._stack_of(stored.images)
    assert list(levels) == [0, 2, 4, 6] and times is None
    _, levels, times = ch.viewer._stack_of(ch.to_host(ch.device_zeros((3, 5, 5))))
    assert list(levels) == [0, 1, 2] and times is None
