"""Looking at the wavefield: the interactive slice widget, side-by-side comparison, animation."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from .memory import CpuDeviceArray
from .disk import StoredImages, StoredRun, open_store
from .distributed.results import HaloResult
from .solver import Result

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import matplotlib.figure
    from numpy.typing import ArrayLike

    #: What the viewers take: a Result, a stack of slices (n, n0, n1) or the path of a store.
    Slices = Result | ArrayLike | str | os.PathLike

__all__ = ["plot_slices", "compare_slices", "animate", "Animation", "SliceViewer", "colour_limit", "show_code",
           "SCALES"]


def _opened(source):
    """A store path opened lazily (:func:`course_helper.disk.open_store`); anything else as it is."""
    if isinstance(source, (str, os.PathLike)):
        return open_store(source)
    return source


def _stack_of(result_or_images, lazy=False):
    """(images, levels, times_ms or None) from a Result, a store path or an array (n, n0, n1).

    With ``lazy`` a store's images stay on disk (indexing reads one slice)."""
    result_or_images = _opened(result_or_images)
    levels = times = None
    if isinstance(result_or_images, (Result, StoredRun)):
        images, levels, times = result_or_images.images, result_or_images.levels, result_or_images.times_ms
    elif isinstance(result_or_images, HaloResult):          # the gathered levels, without their numbers
        images = result_or_images.images
    elif isinstance(result_or_images, StoredImages):        # a store's images know their levels
        images, levels = result_or_images, result_or_images.levels
    else:
        images = result_or_images
    if type(images).__module__.startswith("cupy") or isinstance(images, CpuDeviceArray):
        raise TypeError("plot a host array: bring device data back with to_host() first")
    if not (lazy and isinstance(result_or_images, StoredRun)):
        images = np.asarray(images)
    if images.ndim != 3 or images.shape[0] < 1:
        raise ValueError(f"expected a stack of 2D slices with shape (n, n0, n1), got shape {images.shape}")
    levels = np.arange(images.shape[0]) if levels is None else levels
    return images, np.asarray(levels), times


#: The slice viewer's colour scales and the colormap each uses by default.
SCALES = {"symmetric": "seismic", "sequential": "viridis"}


def colour_limit(images: np.ndarray | None, clip: float = 0.05, peak: float | None = None) -> float:
    """Symmetric colour limit shared by all slices.

    ``clip`` is the fraction of the largest amplitude to saturate at: 1.0
    shows the full range; the default 0.05 keeps the faint wavefront visible
    next to the strong source.
    """
    if not 0 < clip <= 1:
        raise ValueError(f"clip must be in (0, 1], got {clip}")
    if peak is None:              # the largest finite amplitude (``peak`` given: trust it)
        peak = _largest_amplitude(images)
    return peak * clip if peak > 0 else 1.0


def _largest_amplitude(images):
    """The largest finite |value| of a stack (0.0 if none), one slice at a time: no temporary
    array the size of the stack."""
    images = np.asarray(images) if not hasattr(images, "ndim") else images
    best = 0.0
    for image in (images if images.ndim == 3 else [images]):
        amplitude = np.abs(np.asarray(image))
        finite = amplitude[np.isfinite(amplitude)]
        if finite.size:
            best = max(best, float(finite.max()))
    return best


def _ipympl_active():
    import matplotlib
    return "ipympl" in matplotlib.get_backend().lower() or "widget" in matplotlib.get_backend().lower()


class SliceViewer:
    """The slice widget: a slider and a play button over the saved levels.

    Attributes
    ----------
    slider : ipywidgets.IntSlider
        Move it (or set ``slider.value``) to show another slice.
    play : ipywidgets.Play
    caption : ipywidgets.Label
        The slice's level and time as text (the same words as the figure title).
    figure, image : the matplotlib figure and its AxesImage
    index : int
        The slice shown now.
    """

    def __init__(self, result_or_images: Slices, clip: float = 0.05, cmap: str | None = None,
                 title: str = "wavefield", scale: str = "symmetric", label: str = "amplitude"):
        import ipywidgets as widgets
        import matplotlib.pyplot as plt

        if scale not in SCALES:
            raise ValueError(f"scale must be one of {', '.join(repr(s) for s in SCALES)}, got {scale!r}: "
                             "'symmetric' for a field of both signs (the wave), 'sequential' for one that "
                             "is never negative (a concentration)")
        source = _opened(result_or_images)
        self.images, self.levels, self.times_ms = _stack_of(source, lazy=True)
        if scale == "sequential" and isinstance(self.images, np.ndarray) and np.nanmin(self.images) < 0:
            raise ValueError(f"scale='sequential' draws 0 up to the peak, but these slices go down to "
                             f"{np.nanmin(self.images):.3g}: use scale='symmetric' for a field of both signs")
        self.label = title
        # A store knows each level's peak: no need to read every slice for the colour scale.
        peak = source.peak_amplitude() if isinstance(source, StoredRun) else None
        self.vlim = colour_limit(self.images, clip, peak=peak)
        # The wave swings both ways about zero: a diverging map, symmetric. A concentration is
        # never negative: a sequential map from zero, so that no colour stands for values it never takes.
        vmin = -self.vlim if scale == "symmetric" else 0.0
        cmap = cmap or SCALES[scale]
        self.interactive = _ipympl_active()
        n = self.images.shape[0]
        self.slider = widgets.IntSlider(value=0, min=0, max=n - 1, description="slice",
                                        continuous_update=True, layout=widgets.Layout(width="60%"))
        self.play = widgets.Play(value=0, min=0, max=n - 1, interval=60, description="play")
        # One link, kept by Python: setting either value in code sets the other at once, so the
        # browser never holds a value the kernel has not seen. (A browser-side jslink echoed the
        # slider's old value back through the play button after later cells had moved it.)
        self._link = widgets.link((self.play, "value"), (self.slider, "value"))
        self.caption = widgets.Label(value="")

        # Made with interactive mode off, so the figure appears once: inside the widget.
        with plt.ioff():
            self.figure, ax = plt.subplots(figsize=(5.5, 4.6))
        self.out = None if self.interactive else widgets.Output()
        self.ax = ax
        self.image = ax.imshow(self.images[0], cmap=cmap, vmin=vmin, vmax=self.vlim,
                               origin="upper", interpolation="nearest")
        self.colorbar = self.figure.colorbar(self.image, ax=ax, label=label, shrink=0.85)
        ax.set_xlabel("cell index (dimension 1)")
        ax.set_ylabel("cell index (dimension 0)")
        self.index = -1
        self.show(0)
        self.slider.observe(lambda ch: self.show(ch["new"]), names="value")
        children = [widgets.HBox([self.play, self.slider, self.caption])]
        children.append(self.figure.canvas if self.interactive else self.out)
        self.widget = widgets.VBox(children)

    def title_for(self, i: int) -> str:
        """The caption of slice ``i``: its level, and its time where the source gives times."""
        level = int(self.levels[i])
        if self.times_ms is not None:
            return f"{self.label}: level {level}, t = {float(self.times_ms[i]):.2f} ms"
        return f"{self.label}: slice {level}"

    def show(self, i: int) -> None:
        """Display slice ``i``."""
        i = int(i)
        if not 0 <= i < self.images.shape[0]:
            raise IndexError(f"slice {i} is outside 0..{self.images.shape[0] - 1}")
        self.index = i
        self.image.set_data(self.images[i])
        self.ax.set_title(self.title_for(i))
        self.caption.value = self.title_for(i)
        if self.interactive:
            self.figure.canvas.draw_idle()
        else:
            from IPython.display import display
            self.out.clear_output(wait=True)
            with self.out:
                display(self.figure)

    @property
    def title(self) -> str:
        """The figure's title now (the shown slice's caption)."""
        return self.ax.get_title()

    def png(self, dpi: float = 72) -> bytes:
        """The figure as it shows now, as PNG bytes."""
        import io
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
        return buffer.getvalue()

    def _repr_mimebundle_(self, include=None, exclude=None):
        # The live widget, plus a picture of the slice it shows for every reader without a
        # kernel (GitHub, nbviewer, JupyterLab before the notebook runs): they show the PNG.
        bundle = self.widget._repr_mimebundle_(include=include, exclude=exclude)
        bundle["image/png"] = self.png()
        return bundle


def plot_slices(result_or_images: Slices, clip: float = 0.05, cmap: str | None = None,
                title: str = "wavefield", scale: str = "symmetric", label: str = "amplitude") -> SliceViewer:
    """Explore a stack of wavefield slices with a slider and a play button.

    Works with ``%matplotlib widget`` (ipympl: the figure redraws in place)
    and with the inline backend (the figure is redrawn into an output area).

    Parameters
    ----------
    result_or_images : Result, array (n, n0, n1), or the path of a store
        A store written by ``solve(..., store=path)`` is opened lazily: only
        the slice shown is read from disk (levels never written show as NaN).
    clip : float
        Saturate the colour scale at this fraction of the peak amplitude
        (same limits for every slice).
    cmap : str, optional
        A matplotlib colormap; default: the scale's (:data:`SCALES`).
    title : str
        What the slices are, at the head of each slice's title ("wavefield: level 40, ...").
    scale : {"symmetric", "sequential"}
        "symmetric" (default): limits symmetric about zero in a diverging map, for a field of both
        signs such as the wave; "sequential": from zero up, for a field never negative such as a
        concentration.
    label : str
        The colour bar's title ("amplitude"; e.g. "concentration v").

    Returns
    -------
    SliceViewer
        Display it (it is the cell's value); ``viewer.slider.value = k`` moves it.
    """
    return SliceViewer(result_or_images, clip=clip, cmap=cmap, title=title, scale=scale, label=label)


def compare_slices(a: Slices, b: Slices, index: int | None = None, clip: float = 0.05,
                   labels: tuple[str, str] = ("a", "b")) -> matplotlib.figure.Figure:
    """Two stacks side by side with their difference, at one slice.

    ``index`` defaults to the slice where the two differ most (or the last
    one when they are identical). Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    ia, levels, _ = _stack_of(a)
    ib, _, _ = _stack_of(b)
    if ia.shape != ib.shape:
        raise ValueError(f"the stacks differ in shape: {ia.shape} vs {ib.shape}")
    if index is None:             # one slice at a time: no float64 copy of the whole stack
        per_slice = np.array([np.nanmax(np.abs(x.astype(np.float64) - y)) for x, y in zip(ia, ib)])
        index = int(np.argmax(per_slice)) if per_slice.max() > 0 else len(ia) - 1
    vlim = colour_limit(None, clip, peak=max(_largest_amplitude(ia), _largest_amplitude(ib)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, img, name in zip(axes, (ia[index], ib[index]), labels):
        im = ax.imshow(img, cmap="seismic", vmin=-vlim, vmax=vlim)
        ax.set_title(f"{name}, level {int(levels[index])}")
    fig.colorbar(im, ax=axes[:2], shrink=0.8)
    diff = ia[index].astype(np.float64) - ib[index]
    dmax = float(np.nanmax(np.abs(diff)))
    im = axes[2].imshow(diff, cmap="PuOr", vmin=-(dmax or 1), vmax=dmax or 1)
    axes[2].set_title(f"difference (max {dmax:.3g})")
    fig.colorbar(im, ax=axes[2], shrink=0.8)
    return fig


class Animation:
    """An animated GIF of the wavefield with a still strip beside it.

    Displayed, it shows ``strip`` (PNG: a few of the animated levels side by side) and then
    ``gif`` (the animation, looping). Both are plain images: they play and show in an
    untrusted notebook, on GitHub, in an HTML export and on the course site, with no
    JavaScript and nothing fetched from the web. ``levels`` are the animated levels, in order.
    """

    def __init__(self, gif: bytes, strip: bytes, levels: list[int]):
        self.gif, self.strip, self.levels = gif, strip, levels

    @property
    def data(self) -> bytes:
        """The animated GIF's bytes."""
        return self.gif

    def _ipython_display_(self):
        from IPython.display import Image, display
        display(Image(data=self.strip, format="png"))
        display(Image(data=self.gif, format="gif"))


def _first_visible(images, vlim):
    """Index of the first slice with an amplitude at the colour scale's limit somewhere: the
    wave starts from a silent box, and the source is too faint to see for its first levels."""
    loud = np.flatnonzero([np.nanmax(np.abs(image)) >= vlim for image in images])
    return int(loud[0]) if loud.size else 0


def animate(result_or_images: Slices, clip: float = 0.05, step: int = 1, interval: int = 50,
            title: str = "wavefield", dpi: float = 60) -> Animation:
    """An animated GIF of the slices (a plain image: it plays in an untrusted notebook and in
    any export), with a still strip of four of its levels beside it.

    ``step`` shows every ``step``-th slice to keep the GIF small; the animation starts at
    the first slice that reaches the colour scale's limit, so its first frame is never a blank
    box. ``interval`` is each frame's time in milliseconds; ``dpi`` sets the frames' resolution
    (and so the size of the GIF). Returns an :class:`Animation`.
    """
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    images, levels, times = _stack_of(result_or_images)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a whole number >= 1, got {step!r}")
    vlim = colour_limit(images, clip)
    frames = list(range(_first_visible(images, vlim), len(images), step))
    with plt.ioff():
        fig, ax = plt.subplots(figsize=(4.2, 3.8), dpi=dpi)
    im = ax.imshow(images[frames[0]], cmap="seismic", vmin=-vlim, vmax=vlim)
    ax.set_xlabel("cell index (dimension 1)")
    ax.set_ylabel("cell index (dimension 0)")
    pictures = []
    for i in frames:
        im.set_data(images[i])
        ax.set_title(f"{title}: level {int(levels[i])}")
        fig.canvas.draw()
        pictures.append(Image.fromarray(np.asarray(fig.canvas.buffer_rgba())[..., :3]))
    plt.close(fig)
    buffer = io.BytesIO()
    pictures[0].save(buffer, format="GIF", save_all=True, append_images=pictures[1:], duration=interval, loop=0)
    gif = buffer.getvalue()

    shown = [frames[round(j * (len(frames) - 1) / 3)] for j in range(4)] if len(frames) >= 4 else frames
    with plt.ioff():
        fig, axes = plt.subplots(1, len(shown), figsize=(2.4 * len(shown), 2.6), squeeze=False)
    for ax, i in zip(axes[0], shown):
        ax.imshow(images[i], cmap="seismic", vmin=-vlim, vmax=vlim)
        ax.set_title(f"level {int(levels[i])}", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{title}: {len(shown)} of the animation's {len(frames)} frames", fontsize=10)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=72, bbox_inches="tight")
    plt.close(fig)
    return Animation(gif, buffer.getvalue(), [int(levels[i]) for i in frames])


class SourceCode:
    """Source text that Jupyter renders as highlighted Python (via Markdown)."""

    def __init__(self, source: str):
        self.source = source

    def _repr_markdown_(self):
        return f"```python\n{self.source}```"

    def __repr__(self):
        return self.source


def show_code(obj: Callable[..., Any] | type) -> SourceCode:
    """Display the source of a function (e.g. a strategy's loop) as highlighted code.

    The notebooks show the loops this way, so the code you read is the code that runs.
    """
    import inspect
    return SourceCode(inspect.getsource(obj))
