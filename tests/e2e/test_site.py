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


def _new_page(site, browser):
    """A page that records (and blocks) every request for another host, and every failed one."""
    pg = browser.new_page(viewport=WIDE)
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
    return pg


@pytest.fixture
def page(site, browser):
    """A fresh page (see :func:`_new_page`) for a test that opens pages of its own."""
    pg = _new_page(site, browser)
    yield pg
    pg.close()


#: The window the pages are read in, and the narrower one in which no line may be cut off (its
#: text column is about 750 px wide).
WIDE, NARROW = {"width": 1400, "height": 1000}, {"width": 1100, "height": 900}
#: Every block of code or printed text on a page: a cell's code, its printed output, a page's commands.
TEXT_BLOCKS = "article.bd-article pre"
#: The longest line (its first 80 characters) of each of those blocks that hides part of a line past its right edge.
CUT_LINES = """blocks => [...document.querySelectorAll(blocks)]
    .filter(p => p.getClientRects().length && p.scrollWidth > p.clientWidth + 1)
    .map(p => p.innerText.split('\\n').reduce((a, b) => a.length >= b.length ? a : b).slice(0, 80))"""

#: The blocks of a notebook's outputs: each must fit the text column (scrolling inside, if wider).
OUTPUT_BLOCKS = "div.cell_output, div.cell_output > *, div.cell_output pre, div.cell_output img, div.cell_output table"

#: What the walk reads from each page, for the tests below: its broken images, its first heading,
#: the links of its text, its Next and Previous links, the output blocks that reach past the text
#: column and the number of outputs that scroll inside themselves.
READ_PAGE = """blocks => {
    const heading = document.querySelector('main h1');
    const next = document.querySelector('a.right-next'), prev = document.querySelector('a.left-prev');
    const article = document.querySelector('article.bd-article');
    const column = article && article.getBoundingClientRect();
    return {
        broken: [...document.images].filter(i => i.naturalWidth === 0).map(i => i.src),
        title: heading && heading.innerText,
        links: [...document.querySelectorAll('main a')].map(a => a.href),
        next: next && next.href,
        previous: prev && prev.href,
        column: !!column,
        too_wide: !column ? [] : [...document.querySelectorAll(blocks)]
            .map(e => [e.tagName.toLowerCase() + '.' + e.className, e.getBoundingClientRect()])
            .filter(([, r]) => r.right > column.right + 1 || r.left < column.left - 1)
            .map(([what, r]) => `${what}: ${Math.round(r.left)}..${Math.round(r.right)} px, `
                                + `column ${Math.round(column.left)}..${Math.round(column.right)} px`),
        scrolled: [...document.querySelectorAll('div.cell_output pre')]
            .filter(p => p.scrollWidth > p.clientWidth + 1).length,
    };
}"""


@pytest.fixture(scope="module")
def walk(site, browser):
    """Every page of the site opened once, as a reader's browser shows it (the network idle, every
    image loaded, lazy ones too), and what the tests below check on it (:data:`READ_PAGE`, plus the
    requests that went elsewhere or failed while it loaded), by the page's path in the site; on the
    front page and the lessons also the lines cut off in a narrower window (:data:`NARROW`: the
    same page, its window made narrower and wide again). One walk serves every test that looks at
    all the pages: opening a page is what takes the time."""
    pg = _new_page(site, browser)
    seen = {}
    try:
        for name in _pages(site["html"]):
            pg.goto(site["url"] + name, wait_until="networkidle")
            # Lazy images load only in view: ask for all of them now, then wait for each.
            pg.evaluate("() => document.querySelectorAll('img').forEach(i => { i.loading = 'eager'; })")
            pg.wait_for_function("() => [...document.images].every(i => i.complete)", timeout=30_000)
            seen[name] = dict(pg.evaluate(READ_PAGE, OUTPUT_BLOCKS), outside=list(pg.outside), failed=list(pg.failed))
            if name == "index.html" or name in LESSONS:
                pg.set_viewport_size(NARROW)
                seen[name]["cut"] = pg.evaluate(CUT_LINES, TEXT_BLOCKS)
                pg.set_viewport_size(WIDE)
            if seen[name]["broken"] or pg.outside or pg.failed:
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                pg.screenshot(path=str(ARTIFACTS / f"site_{name.replace('/', '_')}.png"))
            pg.outside.clear()
            pg.failed.clear()
    finally:
        pg.close()
    return seen


def _path(url):
    """A link's page, as the walk names it (the site is served from the server's root)."""
    return urllib.parse.urlparse(url).path.lstrip("/")


def _title(heading):
    """A page's first heading without the "#" of its anchor link."""
    return (heading or "").rstrip("#").strip()


def _pages(html):
    return sorted(p.relative_to(html).as_posix() for p in html.rglob("*.html")
                  if not p.relative_to(html).as_posix().startswith(("_static/", "_sources/", "_images/")))


def test_the_site_has_a_page_per_notebook(site):
    pages = _pages(site["html"])
    assert not set(NOTEBOOKS) - set(pages), f"notebooks without a page: {set(NOTEBOOKS) - set(pages)}"


def test_every_page_loads_its_images_and_nothing_from_elsewhere(site, walk):
    assert set(walk) == set(_pages(site["html"]))
    problems = {name: {"broken images": seen["broken"], "outside requests": seen["outside"],
                       "failed requests": seen["failed"]}
                for name, seen in walk.items() if seen["broken"] or seen["outside"] or seen["failed"]}
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


def test_the_navigation_reaches_every_notebook_and_next_walks_the_lessons_in_order(site, page, walk):
    page.goto(site["url"] + "index.html", wait_until="networkidle")
    links = page.evaluate("() => [...document.querySelectorAll('nav.bd-docs-nav a, .bd-sidenav a')].map(a => a.href)")
    reached = {urllib.parse.urlparse(href).path.lstrip("/") for href in links}
    assert set(NOTEBOOKS) <= reached, f"the navigation leaves out {sorted(set(NOTEBOOKS) - reached)}"
    # Following Next from the front page visits the lessons one after the other, no solution between.
    order, here = [], _path(page.url)
    for _ in range(60):
        assert here in walk, f"Next leads to {here}, which is not a page of the site (came through {order})"
        if not walk[here]["next"]:
            break
        here = _path(walk[here]["next"])
        order.append(here)
    visited = [p for p in order if p in NOTEBOOKS]
    assert visited == LESSONS, visited
    # ... and Previous walks them back.
    for before, lesson in zip(LESSONS, LESSONS[1:]):
        back = walk[lesson]["previous"]
        assert back and _path(back) == before, (lesson, back)


def test_each_solution_is_linked_from_its_lesson_and_titled_after_it(walk):
    assert any(SOLUTIONS.values())
    for lesson, solutions in SOLUTIONS.items():
        lesson_title = _title(walk[lesson]["title"])
        linked = {_path(h) for h in walk[lesson]["links"]}
        for solution in solutions:
            assert solution in linked, f"{lesson} has no link to {solution}"
            heading = _title(walk[solution]["title"])
            assert heading == f"Solution: {lesson_title}", (solution, heading)


def test_no_output_is_wider_than_the_text_column(walk):
    """At a 1400 px window no output block reaches past the text column: a wide table scrolls inside
    its own output (and the page says which ones do, in the test's output)."""
    notebooks = LESSONS + [p for sols in SOLUTIONS.values() for p in sols]
    assert all(walk[name]["column"] for name in notebooks), "a notebook's page has no text column"
    too_wide = {name: walk[name]["too_wide"] for name in notebooks if walk[name]["too_wide"]}
    scrolled = {name: walk[name]["scrolled"] for name in notebooks if walk[name]["scrolled"]}
    print("outputs that scroll inside themselves:", scrolled or "none")
    assert not too_wide, too_wide


def test_no_code_or_output_line_is_cut_off_in_a_narrow_column(walk):
    """In a window whose text column is about 750 px wide (:data:`NARROW`), no code or output block
    hides part of a line past its right edge: long lines wrap, so nothing depends on a scrollbar
    that a browser may not show (headless Chromium, overlay scrollbars). Lesson 7's long print
    lines and the README's install line were cut off there."""
    cut = {name: walk[name]["cut"] for name in ["index.html"] + LESSONS if walk[name]["cut"]}
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
