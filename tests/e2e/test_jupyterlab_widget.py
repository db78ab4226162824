"""End to end: the course in a real JupyterLab, driven by headless Chromium.

Starts JupyterLab in a temporary copy of the course with the README's launch
line (only a free port, a token, no browser and, as root, ``--allow-root``
added), checks that every image in the course's notebooks loads and that
opening a notebook does not mark it modified; then runs small notebooks that
use ``plot_slices`` on the CPU backend, moves the slider, presses play, checks
that the slider ends where the last cell set it, and checks what the learner
would see; opens every course notebook and checks that nothing pops up and
nothing is modified. Screenshots go to
``test-artifacts/e2e/``. Needs Debian's chromium (``apt-get install chromium``)
and the Playwright Python package (``pip install -e ".[e2e]"``); .ci/run
installs both. Run alone with ``python -m pytest -m e2e tests/e2e``.
"""
import os
import pathlib
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import nbformat
import pytest

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("COURSE_E2E_CHROMIUM", "/usr/bin/chromium")
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from course_paths import course_notebooks  # noqa: E402
ARTIFACTS = ROOT / "test-artifacts" / "e2e"
WIDGET_ERRORS = re.compile(r"widget|ipympl|matplotlib|jupyter-matplotlib", re.I)

NOTEBOOK = """{{
 "cells": [
  {{"cell_type": "code", "execution_count": null, "id": "c0", "metadata": {{}}, "outputs": [],
   "source": ["%matplotlib {backend}\\n", "import course_helper as ch\\n",
              "result = ch.solve(ch.WaveProblem(n0=96, n1=96, nt=120), 'events', trace=False)\\n",
              "viewer = ch.plot_slices(result, clip=0.05)\\n", "viewer"]}}
 ],
 "metadata": {{"kernelspec": {{"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}}}},
 "nbformat": 4, "nbformat_minor": 5
}}
"""


def readme_launch(cwd):
    """The README's launch line, split into its environment and its command, as a shell run in
    the folder ``cwd`` reads it (``$PWD`` is that folder)."""
    quick = (ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    line = next(x for x in quick.splitlines() if " jupyter lab " in f" {x} ")
    words = shlex.split(line, comments=True)
    env = dict(w.split("=", 1) for w in words if "=" in w and words.index(w) < words.index("jupyter"))
    env = {k: v.replace("$PWD", str(cwd)) for k, v in env.items()}
    return env, words[words.index("jupyter"):]


# Run All sets the slider in two cells; the browser must end where the last cell put it.
RESET_NOTEBOOK = """{
 "cells": [
  {"cell_type": "code", "execution_count": null, "id": "r0", "metadata": {}, "outputs": [],
   "source": ["%matplotlib inline\\n", "import course_helper as ch\\n",
              "result = ch.solve(ch.WaveProblem(n0=96, n1=96, nt=120), 'events', trace=False)\\n",
              "viewer = ch.plot_slices(result, clip=0.05)\\n", "viewer.slider.value = 30\\n", "viewer"]},
  {"cell_type": "code", "execution_count": null, "id": "r1", "metadata": {}, "outputs": [],
   "source": ["viewer.slider.value = 40\\n", "print('slider at', viewer.slider.value)"]}
 ],
 "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}},
 "nbformat": 4, "nbformat_minor": 5
}
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url, timeout):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer {url} within {timeout} s (last error: {last})")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        if os.environ.get("COURSE_E2E_REQUIRED"):
            pytest.fail(f"Chromium not found at {CHROMIUM}, but COURSE_E2E_REQUIRED is set (as in CI)")
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium); .ci/run installs it")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the e2e extra)")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab (the lab extra)")
    root = tmp_path_factory.mktemp("course")
    # A temporary copy of the course, plus small notebooks that use the same plot_slices.
    for folder in ("notebooks", "images", "jupyter-config"):
        shutil.copytree(ROOT / folder, root / folder)
    (root / "notebooks" / "widget.ipynb").write_text(NOTEBOOK.format(backend="widget"))
    (root / "notebooks" / "inline.ipynb").write_text(NOTEBOOK.format(backend="inline"))
    (root / "notebooks" / "reset.ipynb").write_text(RESET_NOTEBOOK)
    # Started as the README says, from the course root; the test adds only what a headless run needs.
    readme_env, command = readme_launch(root)
    assert all(os.path.isabs(v) for k, v in readme_env.items() if k.endswith("_PATH")), readme_env
    jupyter = pathlib.Path(sys.executable).with_name("jupyter")   # this environment's jupyter
    command = [str(jupyter) if jupyter.exists() else command[0], *command[1:]]
    port, token = _free_port(), secrets.token_hex(16)
    command += ["--no-browser", f"--ServerApp.port={port}", f"--IdentityProvider.token={token}"]
    if os.geteuid() == 0:
        command.append("--allow-root")                    # what the README tells root to add
    env = dict(os.environ, **readme_env, COURSE_HELPER_BACKEND="cpu", JUPYTER_RUNTIME_DIR=str(root / ".runtime"))
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=90)
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "root": root, "command": command}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "lab.log", ARTIFACTS / "lab.log")


@pytest.fixture(scope="module")
def browser(lab):
    """One headless Chromium for the module (started once: each test gets a context of its own)."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                      args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                            "--disable-component-update", "--no-first-run", "--disable-sync"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(lab, browser):
    """A page in a browser context of its own: no cookies, storage or cache from another test, as
    in a browser just started."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    try:
        pg = context.new_page()
        pg.set_default_timeout(60_000)
        pg.console_errors = []
        pg.on("console", lambda m: m.type == "error" and pg.console_errors.append(m.text))
        yield pg
    finally:
        context.close()


def _open(page, lab, name):
    # A fresh workspace per notebook, so JupyterLab does not reopen another test's tab.
    workspace = re.sub(r"[^A-Za-z0-9]", "-", name)
    page.goto(f"{lab['url']}/lab/workspaces/{workspace}/tree/notebooks/{name}?reset&token={lab['token']}")
    page.wait_for_selector(".jp-Notebook", timeout=90_000)


COURSE_NOTEBOOKS = sorted(p.relative_to(ROOT / "notebooks").as_posix()
                          for p in course_notebooks(ROOT))


def _image_links(name):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)", text) + re.findall(r'<img[^>]+src="([^"]+)"', text)


def _broken_images(page, lab, name):
    """The images of the open notebook ``name`` that did not load (none when it links no image)."""
    if not _image_links(name):
        return []
    images = page.locator(".jp-Notebook .jp-RenderedMarkdown img")
    images.first.wait_for(timeout=60_000)
    # JupyterLab renders a long notebook's cells as they come into view: bring each one there.
    cells = page.locator(".jp-Notebook .jp-Cell")
    for i in range(cells.count()):
        cells.nth(i).scroll_into_view_if_needed()
    wanted = len(_image_links(name))
    try:
        page.wait_for_function("(n) => document.querySelectorAll('.jp-Notebook .jp-RenderedMarkdown img').length >= n",
                               arg=wanted, timeout=30_000)
    except Exception:                                   # noqa: BLE001 - the count below says what is missing
        pass
    assert images.count() == wanted, "not every image link became an image"
    broken = []
    for i in range(images.count()):
        image = images.nth(i)
        image.scroll_into_view_if_needed()
        try:
            page.wait_for_function("(i) => i.complete", arg=image.element_handle(), timeout=20_000)
        except Exception:                               # noqa: BLE001 - reported below as not loaded
            pass
        if image.evaluate("(i) => i.naturalWidth") == 0:
            broken.append(image.get_attribute("src"))
    if broken:
        page.screenshot(path=str(ARTIFACTS / f"broken_images_{name.replace('/', '_')}.png"))
    return broken


def _cell_calling(nb, call):
    """Index of the first code cell that calls ``call``."""
    return next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and call in c.source)


def test_stored_widget_and_animation_show_pictures_before_anything_runs(lab, page):
    # The notebook as a reader first sees it: stored outputs, untrusted, no widget state.
    name = "04_wave_equation.ipynb"
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    _open(page, lab, name)
    cells = page.locator(".jp-Notebook .jp-Cell")
    for call in ("ch.plot_slices(", "ch.animate("):
        cell = cells.nth(_cell_calling(nb, call))
        cell.scroll_into_view_if_needed()
        images = cell.locator(".jp-OutputArea-output img")
        images.first.wait_for(timeout=30_000)
        for i in range(images.count()):
            page.wait_for_function("(i) => i.complete && i.naturalWidth > 0", arg=images.nth(i).element_handle(),
                                   timeout=20_000)
        text = cell.locator(".jp-OutputArea").inner_text()
        assert "VBox(children" not in text and "Error displaying widget" not in text, text[:200]


def _no_news_popup(page):
    """No notification asks about Jupyter news (or anything else) when the course opens."""
    asking = page.get_by_text(re.compile("official Jupyter news|notified about", re.I))
    toasts = page.locator(".Toastify__toast, .jp-toast-message")
    return asking.count() == 0 and toasts.count() == 0


def test_jupyterlab_is_told_to_fetch_no_news(lab, page):
    _open(page, lab, "01_setup_and_device.ipynb")
    config = page.evaluate("JSON.parse(document.getElementById('jupyter-config-data').textContent)")
    assert config["news"] == {"disabled": True}, "the course's settings turn JupyterLab's news feed off"
    token = lab["token"]
    reply = page.evaluate(
        "async (t) => (await fetch('/lab/api/settings/@jupyterlab/apputils-extension:notification"
        "?token=' + t)).json()", token)
    # What the front end reads: the user's own choice if any, else the default (overridden by the course).
    fetch_news = reply["settings"].get("fetchNews", reply["schema"]["properties"]["fetchNews"]["default"])
    assert fetch_news == "false", f"fetchNews is {fetch_news!r}: the front end would ask about news"


_MSG_ID = re.compile(r'"msg_id":\s*"([^"]+)"')
_IDLE = re.compile(r'"execution_state":\s*"idle"')


def _watch_kernel_info(page):
    """Follow the page's kernel connections (call before the page opens a notebook): return a
    function that says whether every kernel_info request the page has sent has its reply and the
    kernel's idle status after it. JupyterLab writes the reply's language_info into the notebook's
    metadata when both have arrived: from then on, a notebook whose stored metadata differs would be
    marked modified. (The frames are the kernel messages' JSON, whole or in the binary framing of
    jupyter_server's v1 protocol: a request is found by its msg_id, its answers by their parent's.)"""
    asked, replied, idle = [], set(), set()

    def text(payload):
        return payload if isinstance(payload, str) else payload.decode("utf-8", "replace")

    def sent(payload):
        frame = text(payload)
        if "kernel_info_request" in frame and (msg_id := _MSG_ID.search(frame)):
            asked.append(msg_id.group(1))

    def received(payload):
        frame = text(payload)
        for msg_id in asked:
            if msg_id in frame:
                if "kernel_info_reply" in frame:
                    replied.add(msg_id)
                elif _IDLE.search(frame):
                    idle.add(msg_id)

    def connected(ws):
        ws.on("framesent", sent)
        ws.on("framereceived", received)

    page.on("websocket", connected)
    return lambda: bool(asked) and all(m in replied and m in idle for m in asked)


def _wait_until(page, condition, timeout, what):
    """Let the page run until ``condition()`` holds (it reads what the page's events recorded)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        page.wait_for_timeout(100)


@pytest.mark.parametrize("name", COURSE_NOTEBOOKS)
def test_opening_a_notebook_asks_nothing_changes_nothing_and_loads_every_image(lab, page, name):
    # One opening per notebook checks both (each opening starts a kernel: the suite's slowest step).
    # The stored notebook as it is: it names no Python, and the course's settings fill in this one.
    path = lab["root"] / "notebooks" / name
    before = path.read_bytes()
    kernel_info = _watch_kernel_info(page)
    _open(page, lab, name)
    page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
    _wait_until(page, kernel_info, 90, f"the kernel's reply to {name}'s kernel_info request")
    page.wait_for_timeout(500)              # the front end writes language_info and redraws its tab
    shot = ARTIFACTS / f"opened_{name.replace('/', '_')}.png"
    popup = not _no_news_popup(page)
    dirty = page.locator(".lm-TabBar-tab.jp-mod-dirty").count()
    if popup or dirty:
        page.screenshot(path=str(shot))
    broken = _broken_images(page, lab, name)            # after the checks above: scrolling renders cells
    # Shut the kernel down, so that the notebooks opened one after another do not pile up kernels.
    page.evaluate("async (t) => { const s = await (await fetch('/api/sessions?token=' + t)).json();"
                  " for (const x of s) await fetch('/api/sessions/' + x.id + '?token=' + t, {method: 'DELETE'}); }",
                  lab["token"])
    assert not popup, f"a notification covers {name} when it opens (see {shot})"
    assert dirty == 0, f"opening {name} marked it modified (its stored metadata differs from the kernel's)"
    assert path.read_bytes() == before, f"opening {name} rewrote the file"
    assert not broken, f"{name}: images that did not load with {shlex.join(lab['command'])}: {broken}"


def _open_and_run(page, lab, name):
    _open(page, lab, name)
    # Wait until the kernel is up and idle before running anything.
    page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
    # Run > Run All Cells, as a learner would.
    page.get_by_role("menuitem", name="Run", exact=True).click()
    item = page.get_by_text("Run All Cells", exact=True)
    item.wait_for(timeout=30_000)
    item.click()
    try:
        page.wait_for_selector(".widget-slider", timeout=120_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"failed_{name}.png"))
        raise


def _caption(page):
    return page.locator(".widget-label").filter(has_text="level").first.inner_text()


def _frame(page, selector):
    return page.locator(selector).first.screenshot()


def _move_slider(page, presses):
    """Move the slider with the keyboard; return the level it reached (read from the slider)."""
    handle = page.locator(".widget-slider .noUi-handle").first
    handle.click()
    for _ in range(presses):
        page.keyboard.press("ArrowRight")
        page.wait_for_timeout(40)
    page.wait_for_timeout(500)
    level = int(float(handle.get_attribute("aria-valuenow")))
    assert level > 0, "the slider did not move"
    try:
        page.wait_for_function(
            "(k) => [...document.querySelectorAll('.widget-label')]"
            ".some(e => e.textContent.includes('level ' + k + ','))",
            arg=level, timeout=30_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "failed_slider.png"))
        raise
    return level


def test_slice_widget_moves_and_plays_in_jupyterlab(lab, page):
    _open_and_run(page, lab, "widget.ipynb")
    figure = ".jupyter-matplotlib-canvas-div canvas, .jupyter-matplotlib canvas"
    page.wait_for_selector(figure, timeout=60_000)
    page.wait_for_timeout(1500)                        # let ipympl draw the first frame
    assert "level 0" in _caption(page)
    before = _frame(page, ".jupyter-matplotlib")
    page.screenshot(path=str(ARTIFACTS / "widget_level0.png"))

    level = _move_slider(page, 60)
    page.wait_for_timeout(1500)
    after = _frame(page, ".jupyter-matplotlib")
    page.screenshot(path=str(ARTIFACTS / "widget_moved.png"))
    assert f"level {level}," in _caption(page) and "ms" in _caption(page)
    assert before != after, "the figure did not change when the slider moved"

    page.locator(".widget-play button").first.click()     # play
    first = _caption(page)
    page.wait_for_function(
        "(first) => [...document.querySelectorAll('.widget-label')]"
        ".some(e => /level/.test(e.textContent) && e.textContent !== first)", arg=first, timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "widget_playing.png"))
    assert _caption(page) != first, "pressing play did not advance the frames"

    bad = [m for m in page.console_errors if WIDGET_ERRORS.search(m)]
    assert not bad, f"browser console errors from the widget extensions: {bad}"


def test_inline_fallback_renders_and_updates(lab, page):
    _open_and_run(page, lab, "inline.ipynb")
    image = ".jp-OutputArea-output img"
    page.wait_for_selector(image, timeout=60_000)
    before = page.locator(image).first.get_attribute("src")
    level = _move_slider(page, 40)
    page.wait_for_function("(src) => { const i = document.querySelector('.jp-OutputArea-output img');"
                           " return i && i.getAttribute('src') !== src; }", arg=before, timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "inline_moved.png"))
    assert f"level {level}," in _caption(page)
    bad = [m for m in page.console_errors if WIDGET_ERRORS.search(m)]
    assert not bad, f"browser console errors from the widget extensions: {bad}"


def test_slider_ends_where_the_last_cell_set_it(lab, page):
    _open_and_run(page, lab, "reset.ipynb")
    page.get_by_text("slider at 40").first.wait_for(timeout=60_000)
    page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=60_000)
    page.wait_for_timeout(3000)                          # time for any late update to arrive
    handle = page.locator(".widget-slider .noUi-handle").first
    caption = _caption(page)
    if int(float(handle.get_attribute("aria-valuenow"))) != 40:
        page.screenshot(path=str(ARTIFACTS / "failed_slider_reset.png"))
    assert int(float(handle.get_attribute("aria-valuenow"))) == 40, f"the slider moved back (caption: {caption})"
    assert "level 40," in caption


def test_kernels_run_without_the_plain_tcp_warning(lab, page):
    # Run last: by now the tests above have started kernels under the README's launch (run alone,
    # this test starts one itself).
    if "Kernel started" not in (lab["root"] / "lab.log").read_text():
        _open(page, lab, "07_concurrent_events.ipynb")
        page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=90_000)
    log = (lab["root"] / "lab.log").read_text()
    assert "Kernel started" in log
    assert "without encryption" not in log, "a kernel warned that it runs over TCP without encryption"
