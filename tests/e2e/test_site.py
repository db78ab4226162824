"""End to end: the course site (tools/build_site.py) in headless Chromium.

Serves the built site on a local port and opens every page: every image loads, no request
leaves the site (MathJax, fonts and scripts are all served with it), the maths is typeset,
Next walks the lessons in order and each solution is linked from its lesson, no output is wider
than the text column, and search finds a page and shows what it says. Uses the site in
``COURSE_SITE_DIR`` (CI builds it with the README's command) or builds one into a temporary
folder. Needs Debian's chromium, Playwright (the e2e extra) and Jupyter Book (the site extra).
"""
import functools
import http.server
import os
import pathlib
import re
import sys
import threading
import urllib.parse

import pytest

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("COURSE_E2E_CHROMIUM", "/usr/bin/chromium")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from course_paths import course_notebooks  # noqa: E402
ARTIFACTS = ROOT / "test-artifacts" / "e2e"
NOTEBOOKS = sorted(p.relative_to(ROOT).with_suffix(".html").as_posix() for p in course_notebooks(ROOT))
#: The lessons in the course's order (by their number), and each lesson's solutions.
LESSONS = sorted((p for p in NOTEBOOKS if re.fullmatch(r"notebooks/\d+_\w+\.html", p)),
                 key=lambda p: int(re.search(r"(\d+)_", p).group(1)))
SOLUTIONS = {lesson: [p for p in NOTEBOOKS if p.startswith("notebooks/solutions/")
                      and int(re.search(r"(\d+)_", p).group(1)) == int(re.search(r"(\d+)_", lesson).group(1))]
             for lesson in LESSONS}


def _need(condition, why):
    if not condition:
        if os.environ.get("COURSE_E2E_REQUIRED"):
            pytest.fail(f"{why}, but COURSE_E2E_REQUIRED is set (as in CI)")
        pytest.skip(why)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    _need(os.path.exists(CHROMIUM), f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the e2e extra)")
    if os.environ.get("COURSE_SITE_DIR"):
        html = pathlib.Path(os.environ["COURSE_SITE_DIR"])
        assert (html / "index.html").exists(), f"COURSE_SITE_DIR={html} holds no built site"
    else:
        try:
            import jupyter_book  # noqa: F401
        except ImportError:
            _need(False, 'the site needs Jupyter Book: pip install -e ".[site]"')
        import build_site
        html = build_site.main(["--out", str(tmp_path_factory.mktemp("site"))])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(html)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}/", "html": html}
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def browser(site):
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
def page(site, browser):
    """A page that records (and blocks) every request for another host, and every failed one."""
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    pg.set_default_timeout(30_000)
    pg.outside, pg.failed = [], []

    def route(r):
        if r.request.url.startswith(site["url"]):
            r.continue_()
        else:
            pg.outside.append(r.request.url)
            r.abort()

    pg.route("**/*", route)
    pg.on("response", lambda resp: resp.status >= 400 and pg.failed.append(f"{resp.status} {resp.url}"))
    yield pg
    pg.close()


def _pages(html):
    return sorted(p.relative_to(html).as_posix() for p in html.rglob("*.html")
                  if not p.relative_to(html).as_posix().startswith(("_static/", "_sources/", "_images/")))


def test_the_site_has_a_page_per_notebook(site):
    pages = _pages(site["html"])
    assert not set(NOTEBOOKS) - set(pages), f"notebooks without a page: {set(NOTEBOOKS) - set(pages)}"


def test_every_page_loads_its_images_and_nothing_from_elsewhere(site, page):
    problems = {}
    for name in _pages(site["html"]):
        page.goto(site["url"] + name, wait_until="networkidle")
        # Lazy images load only in view: ask for all of them now, then wait for each.
        page.evaluate("() => document.querySelectorAll('img').forEach(i => { i.loading = 'eager'; })")
        page.wait_for_function("() => [...document.images].every(i => i.complete)", timeout=30_000)
        broken = page.evaluate("() => [...document.images].filter(i => i.naturalWidth === 0).map(i => i.src)")
        if broken or page.outside or page.failed:
            problems[name] = {"broken images": broken, "outside requests": list(page.outside),
                              "failed requests": list(page.failed)}
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"site_{name.replace('/', '_')}.png"))
        page.outside.clear()
        page.failed.clear()
    assert not problems, problems


def test_the_stored_widget_and_animation_show_as_pictures(site, page):
    page.goto(site["url"] + "notebooks/04_wave_equation.html", wait_until="networkidle")
    text = page.locator("main").inner_text()
    assert "live slider" in text, "the slice widget's still picture says how to get the live one"
    assert "VBox(children" not in text and "Error displaying widget" not in text
    assert page.locator("main .cell_output img").count() >= 3


def test_the_maths_is_typeset_by_the_site_s_own_mathjax(site, page):
    page.goto(site["url"] + "notebooks/04_wave_equation.html", wait_until="networkidle")
    src = page.evaluate("() => [...document.scripts].map(s => s.src).filter(s => /MathJax/.test(s))")
    assert src and all(s.startswith(site["url"]) for s in src), src
    # Every formula of the page (Sphinx's "math notranslate") holds a typeset MathJax element.
    page.wait_for_function("() => { const f = [...document.querySelectorAll('.math.notranslate')];"
                           " return f.length > 0 && f.every(e => e.querySelector('span.MathJax')); }",
                           timeout=30_000)
    assert not page.outside, page.outside


def test_the_navigation_reaches_every_notebook_and_next_walks_the_lessons_in_order(site, page):
    page.goto(site["url"] + "index.html", wait_until="networkidle")
    links = page.evaluate("() => [...document.querySelectorAll('nav.bd-docs-nav a, .bd-sidenav a')].map(a => a.href)")
    reached = {urllib.parse.urlparse(href).path.lstrip("/") for href in links}
    assert set(NOTEBOOKS) <= reached, f"the navigation leaves out {sorted(set(NOTEBOOKS) - reached)}"
    # Following Next from the front page visits the lessons one after the other, no solution between.
    order, url = [], site["url"] + "index.html"
    for _ in range(60):
        page.goto(url, wait_until="networkidle")        # index.html forwards to the front page
        following = page.locator("a.right-next")
        if following.count() == 0:
            break
        url = following.first.evaluate("a => a.href")
        order.append(urllib.parse.urlparse(url).path.lstrip("/"))
    visited = [p for p in order if p in NOTEBOOKS]
    assert visited == LESSONS, visited
    # ... and Previous walks them back.
    for before, lesson in zip(LESSONS, LESSONS[1:]):
        page.goto(site["url"] + lesson, wait_until="networkidle")
        back = page.locator("a.left-prev").first.evaluate("a => a.href")
        assert urllib.parse.urlparse(back).path.lstrip("/") == before, (lesson, back)


def test_each_solution_is_linked_from_its_lesson_and_titled_after_it(site, page):
    assert any(SOLUTIONS.values())
    for lesson, solutions in SOLUTIONS.items():
        page.goto(site["url"] + lesson, wait_until="networkidle")
        lesson_title = page.locator("main h1").first.inner_text().rstrip("#").strip()
        hrefs = page.evaluate("() => [...document.querySelectorAll('main a')].map(a => a.href)")
        linked = {urllib.parse.urlparse(h).path.lstrip("/") for h in hrefs}
        for solution in solutions:
            assert solution in linked, f"{lesson} has no link to {solution}"
            page.goto(site["url"] + solution, wait_until="networkidle")
            heading = page.locator("main h1").first.inner_text().rstrip("#").strip()
            assert heading == f"Solution: {lesson_title}", (solution, heading)


#: The blocks of a notebook's outputs: each must fit the text column (scrolling inside, if wider).
OUTPUT_BLOCKS = "div.cell_output, div.cell_output > *, div.cell_output pre, div.cell_output img, div.cell_output table"


def test_no_output_is_wider_than_the_text_column(site, page):
    """At a 1400 px window no output block reaches past the text column: a wide table scrolls inside
    its own output (and the page says which ones do, in the test's output)."""
    too_wide, scrolled = {}, {}
    for name in LESSONS + [p for sols in SOLUTIONS.values() for p in sols]:
        page.goto(site["url"] + name, wait_until="networkidle")
        found = page.evaluate("""blocks => {
            const column = document.querySelector('article.bd-article').getBoundingClientRect();
            return [...document.querySelectorAll(blocks)]
                .map(e => [e.tagName.toLowerCase() + '.' + e.className, e.getBoundingClientRect()])
                .filter(([, r]) => r.right > column.right + 1 || r.left < column.left - 1)
                .map(([what, r]) => `${what}: ${Math.round(r.left)}..${Math.round(r.right)} px, `
                                    + `column ${Math.round(column.left)}..${Math.round(column.right)} px`);
        }""", OUTPUT_BLOCKS)
        if found:
            too_wide[name] = found
        inside = page.evaluate("() => [...document.querySelectorAll('div.cell_output pre')]"
                               ".filter(p => p.scrollWidth > p.clientWidth + 1).length")
        if inside:
            scrolled[name] = inside
    print("outputs that scroll inside themselves:", scrolled or "none")
    assert not too_wide, too_wide


#: Every block of code or printed text on a page: a cell's code, its printed output, a page's commands.
TEXT_BLOCKS = "article.bd-article pre"


def test_no_code_or_output_line_is_cut_off_in_a_narrow_column(site, browser):
    """In a window whose text column is about 750 px wide, no code or output block hides part of a
    line past its right edge: long lines wrap, so nothing depends on a scrollbar that a browser may
    not show (headless Chromium, overlay scrollbars). Lesson 7's long print lines and the README's
    install line were cut off there."""
    pg = browser.new_page(viewport={"width": 1100, "height": 900})
    cut = {}
    try:
        for name in ["index.html"] + LESSONS:
            pg.goto(site["url"] + name, wait_until="networkidle")
            hidden = pg.evaluate("""blocks => [...document.querySelectorAll(blocks)]
                .filter(p => p.getClientRects().length && p.scrollWidth > p.clientWidth + 1)
                .map(p => p.innerText.split('\\n').reduce((a, b) => a.length >= b.length ? a : b).slice(0, 80))""",
                                 TEXT_BLOCKS)
            if hidden:
                cut[name] = hidden
    finally:
        pg.close()
    assert not cut, cut


def test_search_finds_a_lesson_and_shows_what_it_says(site, page):
    """Served as the README says, search lists the pages and the text around the word in each,
    which it reads from the pages themselves (opened from the file system, a browser refuses those
    reads: the README gives the command that serves the site)."""
    refused = []
    page.on("console", lambda m: m.type == "error" and re.search(r"CORS|fetch|load", m.text, re.I)
            and refused.append(m.text))
    page.goto(site["url"] + "search.html?q=pinned", wait_until="networkidle")
    results = page.locator("#search-results li")
    results.first.wait_for(timeout=30_000)
    hrefs = page.evaluate("() => [...document.querySelectorAll('#search-results li a')].map(a => a.href)")
    assert any("03_pinned_memory" in h for h in hrefs), hrefs
    # Each result's summary is the text around the word, read from its page.
    page.wait_for_function("() => document.querySelectorAll('#search-results li p.context').length > 0",
                           timeout=30_000)
    summaries = page.evaluate("() => [...document.querySelectorAll('#search-results li p.context')]"
                              ".map(p => p.innerText)")
    assert any("pinned" in s.lower() for s in summaries), summaries
    assert not refused and not page.failed, (refused, page.failed)
