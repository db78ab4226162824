"""Build the course site: the README, docs/ and the notebooks as static HTML.

Run from the repository root (needs the ``site`` extra: pip install -e ".[site]"):

    python3 tools/build_site.py            # the site lands in _build/site/html/index.html
    python3 -m http.server -d _build/site/html 8000      # serve it: http://localhost:8000/

Jupyter Book 1.x builds it from the notebooks' stored outputs (nothing is executed), with
docs/_config.yml as its settings and docs/_toc.yml as its map, whose part "The course" the build
fills in: every lesson ``notebooks/NN_*.ipynb`` in number order, each lesson's solutions
(``notebooks/solutions/NN_*_solution.ipynb``) under it. Next and Previous walk the lessons and skip
the solutions (tools/site_navigation.py); each solution is titled "Solution: <its lesson's title>"
and linked at the end of its lesson. The build works on a copy of the course (``OUT/src``) in which:

- each slice widget's stored output keeps only its still picture, with a note saying how to
  get the live slider (a static page has no kernel to move it);
- any stored output that needs JavaScript to show (an animation from an older run) is replaced
  by a note saying how to see it, and every other HTML or SVG output passes through an HTML
  sanitiser (nh3) that keeps only an explicit list of elements and attributes: no script in any
  spelling, no event handler, nothing fetched from another host;
- the markdown's own HTML may use only those elements and attributes (the build stops, naming
  the page, where it uses another);
- MathJax comes from the jupyter-server-mathjax package and is served with the site, so
  viewing the site fetches nothing from another host;
- every file the pages link to (benchmark results, profiles, scripts) is copied along, so the
  links work on the site too, but only files of the course: those git tracks or would track
  (a link to ``../.git/config`` stops the build); SVG pictures are sanitised like outputs.

``--out OUT`` (default ``_build/site``) must be a new or empty folder, or one this script built
(it holds the marker file ``.course-site`` this script wrote): anything else is refused before a file
is written, and so is an ``--out`` that is itself a symbolic link, a marker, ``src/``, ``html/`` or
``_build/`` there that is a symbolic link, and a marker that is not a regular file with no other
name. Emptying ``src/`` and ``html/`` removes the links inside them, never what they point to.
"""
import argparse
import copy
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from html.parser import HTMLParser

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "_build" / "site"
#: The file that marks a folder as one this script builds into (and may empty).
MARKER = ".course-site"
#: The part of docs/_toc.yml that the build fills in with the lessons.
COURSE_PART = "The course"
LESSON = re.compile(r"(\d+)_\w+\.ipynb")
SOLUTION = re.compile(r"(\d+)_\w+_solution\.ipynb")
WIDGET = "application/vnd.jupyter.widget-view+json"
LIVE_SLIDER = ("*On this page: a still picture of the slice the stored run showed. The live slider and "
               "play button need a running kernel: open the notebook in JupyterLab (README, Quick start) "
               "and run it.*")
NEEDS_SCRIPT = ("*This output needs JavaScript that a static page does not run. Open the notebook in "
                "JupyterLab (README, Quick start) and run the cell to see it.*")
# The pages' relative links: [text](target) and <img src="target">.
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)|src=\"([^\"#]+)\"")

# -- what HTML may reach the site: an allow-list, applied by nh3 -------------------------------------
#: Elements of HTML outputs and of the markdown's own HTML (nh3's defaults: text, tables, lists,
#: images, <details>); no script, style, form, frame, object or SVG element.
HTML_TAGS = frozenset({
    "a", "abbr", "b", "blockquote", "br", "caption", "cite", "code", "col", "colgroup", "dd", "del", "details",
    "div", "dl", "dt", "em", "figcaption", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "i", "img", "ins",
    "kbd", "li", "mark", "ol", "p", "pre", "q", "s", "samp", "small", "span", "strong", "sub", "summary", "sup",
    "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul", "var", "wbr"})
#: Their attributes: no event handler (on...), no style sheets beyond a few layout properties.
HTML_ATTRIBUTES = {"*": {"class", "id", "title", "style", "align", "width", "height"},
                   "a": {"href"}, "img": {"src", "alt"}, "td": {"colspan", "rowspan"},
                   "th": {"colspan", "rowspan", "scope"}, "ol": {"start"}, "details": {"open"}}
STYLE_PROPERTIES = frozenset({"display", "text-align", "vertical-align", "width", "height", "max-width",
                              "margin", "padding", "color", "background-color", "font-weight", "font-style",
                              "font-family", "font-size", "white-space", "border", "border-collapse"})
#: SVG pictures: the elements matplotlib draws with (paths, glyphs used by reference, clipping).
SVG_TAGS = frozenset({"svg", "g", "defs", "path", "use", "clipPath", "rect", "circle", "ellipse", "line",
                      "polyline", "polygon", "text", "tspan", "title", "desc", "linearGradient",
                      "radialGradient", "stop", "pattern", "mask", "symbol", "image"})
SVG_ATTRIBUTES = {"*": {"id", "class", "style", "transform", "d", "x", "y", "x1", "x2", "y1", "y2", "cx", "cy",
                        "r", "rx", "ry", "width", "height", "points", "viewBox", "version", "xmlns",
                        "preserveAspectRatio", "clip-path", "clipPathUnits", "fill", "fill-opacity", "stroke",
                        "stroke-width", "stroke-opacity", "stroke-linejoin", "stroke-linecap", "opacity",
                        "font-size", "font-family", "text-anchor", "offset", "stop-color", "stop-opacity",
                        "gradientUnits", "gradientTransform", "patternUnits", "mask", "xlink:href", "href"}}
SVG_STYLE_PROPERTIES = frozenset({"fill", "fill-opacity", "stroke", "stroke-width", "stroke-opacity",
                                  "stroke-linejoin", "stroke-linecap", "stroke-dasharray", "stroke-dashoffset",
                                  "stroke-miterlimit", "opacity", "font-size", "font-family", "font-weight",
                                  "font-style", "text-anchor", "clip-path", "mask", "display", "visibility",
                                  "stop-color", "stop-opacity", "paint-order"})
#: URLs a link may point to (relative ones always may); an image may also be an inline picture.
URL_SCHEMES = frozenset({"http", "https", "mailto"})
DATA_IMAGE = re.compile(r"data:image/(png|jpeg|gif);base64,[A-Za-z0-9+/=\s]*")


class SiteError(Exception):
    """What stops the build before it writes anything, said so that the reader can fix it."""


_ABSOLUTE = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):|//")       # a URL with a scheme, or to another host


def url_allowed(tag, attribute, value):
    """Whether an attribute's URL may reach the site: what a page loads with itself (an image's
    ``src``, an SVG ``<use>`` or ``<image>``'s ``href``) is a file of the site, a fragment of the same
    picture or an inline picture, never something from another host; a link (``<a href>``) is
    relative or ``http``, ``https`` or ``mailto``. Any other attribute is not a URL."""
    value = value.strip()
    absolute = _ABSOLUTE.match(value)
    if attribute == "src" or (tag in ("use", "image") and attribute in ("href", "xlink:href")):
        return bool(DATA_IMAGE.fullmatch(value)) or not absolute
    if attribute in ("href", "xlink:href"):
        return not absolute or (absolute.group(1) or "").lower() in URL_SCHEMES
    return True


def _keep_url(tag, attribute, value):
    """nh3's last word on each attribute it kept (:func:`url_allowed`)."""
    return value if url_allowed(tag, attribute, value) else None


def clean_html(html):
    """An HTML output as the site shows it: only :data:`HTML_TAGS` and their attributes, no script
    (any spelling), no event handler, no image from another host."""
    import nh3
    return nh3.clean(html, tags=set(HTML_TAGS), attributes=copy.deepcopy(HTML_ATTRIBUTES),
                     filter_style_properties=set(STYLE_PROPERTIES), url_schemes=set(URL_SCHEMES) | {"data"},
                     attribute_filter=_keep_url, strip_comments=True)


def clean_svg(svg, name="an SVG picture"):
    """An SVG picture as the site publishes it: only :data:`SVG_TAGS` and their attributes (no
    script, no event handler, no foreign object, nothing fetched), still a well-formed SVG file."""
    import nh3
    text = nh3.clean(svg, tags=set(SVG_TAGS), attributes=copy.deepcopy(SVG_ATTRIBUTES),
                     filter_style_properties=set(SVG_STYLE_PROPERTIES), url_schemes={"data"},
                     attribute_filter=_keep_url, strip_comments=True, link_rel=None).strip()
    # nh3 writes HTML, which needs no XML namespace declarations; an SVG file on its own does.
    for name, uri in (("xmlns", "http://www.w3.org/2000/svg"), ("xmlns:xlink", "http://www.w3.org/1999/xlink")):
        if f'{name}="' not in text.split(">", 1)[0]:
            text = re.sub(r"<svg\b", f'<svg {name}="{uri}"', text, count=1)
    try:
        ElementTree.fromstring(text)
    except ElementTree.ParseError as err:
        raise SiteError(f"{name} is not a picture the site can publish once its scripts are gone ({err}): "
                        "draw it again (tools/make_diagrams.py draws the course's diagrams)") from None
    return text


class _RawHTML(HTMLParser):
    """The elements and attributes of a page's own HTML that :data:`HTML_TAGS` does not allow."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.refused = []

    def handle_starttag(self, tag, attrs):
        if tag not in HTML_TAGS:
            self.refused.append(f"<{tag}>")
        allowed = HTML_ATTRIBUTES["*"] | HTML_ATTRIBUTES.get(tag, set())
        for name, value in attrs:
            if name not in allowed:
                self.refused.append(f"<{tag} {name}=...>")
            elif not url_allowed(tag, name, value or ""):
                self.refused.append(f'<{tag} {name}="{value}">')


def check_markdown_html(text, page):
    """Stop the build where a page's markdown holds HTML beyond the allow-list (its code is not
    looked at: `<script>` in backticks is text)."""
    from markdown_it import MarkdownIt
    raw = []
    for token in MarkdownIt("commonmark").parse(text):
        if token.type == "html_block":
            raw.append(token.content)
        raw += [child.content for child in token.children or [] if child.type == "html_inline"]
    parser = _RawHTML()
    parser.feed("\n".join(raw))
    parser.close()
    if parser.refused:
        raise SiteError(f"{page} uses HTML the site does not publish: {', '.join(sorted(set(parser.refused)))}; "
                        f"allowed are {', '.join(sorted(HTML_TAGS))} with their plain attributes")


# -- the pages ---------------------------------------------------------------------------------------
def _note(text):
    return nbformat.v4.new_output("display_data", data={"text/markdown": text})


def static_outputs(nb):
    """The notebook with every output a static page can show as it is (see the module's text)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET in data:
                data.pop(WIDGET)
                outputs += [out, _note(LIVE_SLIDER)] if "image/png" in data else [_note(LIVE_SLIDER)]
                continue
            if "application/javascript" in data:
                outputs.append(_note(NEEDS_SCRIPT))
                continue
            if "text/html" in data:
                data["text/html"] = clean_html(data["text/html"])
            if "image/svg+xml" in data:
                data["image/svg+xml"] = clean_svg(data["image/svg+xml"], "an SVG output")
            outputs.append(out)
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return nb


def title(nb):
    """A notebook's title: the text of its first level-1 heading."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^# +(.+?)\s*$", cell.source, re.M)
            if match:
                return match.group(1)
    raise SiteError("a notebook has no title: its first markdown cell should start with '# <title>'")


def course(root=ROOT):
    """The lessons in order, each with its solutions: ``[(lesson, [solution, ...]), ...]``.

    A lesson is ``notebooks/NN_name.ipynb`` (NN its number); a solution is
    ``notebooks/solutions/NN_name_solution.ipynb``, answering lesson NN."""
    lessons = sorted((p for p in (root / "notebooks").glob("*.ipynb") if LESSON.fullmatch(p.name)),
                     key=lambda p: int(LESSON.fullmatch(p.name).group(1)))
    numbers = [int(LESSON.fullmatch(p.name).group(1)) for p in lessons]
    if len(set(numbers)) < len(numbers):
        raise SiteError(f"two lessons share a number: {[p.name for p in lessons]}")
    solutions = {n: [] for n in numbers}
    for path in sorted((root / "notebooks" / "solutions").glob("*.ipynb")):
        match = SOLUTION.fullmatch(path.name)
        if not match or int(match.group(1)) not in solutions:
            raise SiteError(f"notebooks/solutions/{path.name} answers no lesson: name a solution "
                            "NN_name_solution.ipynb after the number NN of its lesson")
        solutions[int(match.group(1))].append(path)
    return [(lesson, solutions[n]) for lesson, n in zip(lessons, numbers)]


def table_of_contents(root=ROOT):
    """docs/_toc.yml with its part :data:`COURSE_PART` listing every lesson, its solutions under it."""
    import yaml
    toc = yaml.safe_load((root / "docs" / "_toc.yml").read_text())
    parts = [p for p in toc.get("parts", []) if p.get("caption") == COURSE_PART]
    if len(parts) != 1:
        raise SiteError(f"docs/_toc.yml needs one part captioned {COURSE_PART!r} (the build lists the lessons there)")

    def entry(path):
        return {"file": path.relative_to(root).with_suffix("").as_posix()}

    parts[0]["chapters"] = [dict(entry(lesson), **({"sections": [entry(s) for s in sols]} if sols else {}))
                            for lesson, sols in course(root)]
    return toc


#: Folders whose files are never the course's, where git cannot say (a copy that is not a checkout).
NOT_THE_COURSE = frozenset({".git", "_build", ".venv", "venv", "__pycache__", ".ipynb_checkpoints"})


def course_files(root=ROOT):
    """The files of the course, the only ones a page may publish: what git tracks, or would track
    (not ignored), in this checkout; in a copy that is not a git checkout, every file outside the
    folders of :data:`NOT_THE_COURSE`."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=root, capture_output=True, check=True).stdout
        return {root / name for name in os.fsdecode(listed).split("\0") if name}
    except (OSError, subprocess.CalledProcessError):
        return {p for p in root.rglob("*") if p.is_file() and not NOT_THE_COURSE & set(p.relative_to(root).parts)}


def linked_files(text, page, allowed, root=ROOT):
    """Files of the course that ``page``'s text links to (not pages, not web addresses); a link to a
    file outside the course (or reached through a symbolic link) stops the build."""
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target) or target.endswith((".md", ".ipynb")):
            continue
        path = pathlib.Path(os.path.normpath(page.parent / target))
        if path.resolve() != path or path not in allowed:
            if path.resolve() == path and root in path.parents and not path.is_file():
                continue                     # a folder, or a broken link: Jupyter Book reports it
            raise SiteError(f"{page.relative_to(root)} links to {target}, which is not a file of the course "
                            "(the site publishes only files git tracks in this folder, never through a "
                            "symbolic link)")
        yield path


def _mathjax():
    """MathJax 2's files from the jupyter-server-mathjax package (Jupyter's own offline copy)."""
    import jupyter_server_mathjax
    return pathlib.Path(jupyter_server_mathjax.__file__).parent / "static"


def plan(root=ROOT):
    """Everything the site will hold, read and checked before anything is written:
    ``(pages, notebooks, linked files, table of contents)``, notebooks as ready-to-write objects."""
    pages = {root / "README.md": (root / "README.md").read_text()}
    pages.update({p: p.read_text() for p in sorted((root / "docs").glob("*.md"))})
    notebooks = {}
    for lesson, solutions in course(root):
        nb = static_outputs(nbformat.read(lesson, as_version=4))
        lesson_title = title(nb)
        for path in solutions:
            sol = static_outputs(nbformat.read(path, as_version=4))
            heading = next(c for c in sol.cells if c.cell_type == "markdown" and re.search(r"^# ", c.source, re.M))
            heading.source = re.sub(r"^# +.+$", f"# Solution: {lesson_title}", heading.source, count=1, flags=re.M)
            notebooks[path] = sol
            nb.cells.append(nbformat.v4.new_markdown_cell(
                f"**Solution:** [Solution: {lesson_title}](solutions/{path.name})"))
        notebooks[lesson] = nb
    allowed, linked = course_files(root), set()
    for page, text in pages.items():
        check_markdown_html(text, page.relative_to(root))
        linked.update(linked_files(text, page, allowed, root))
    for path, nb in notebooks.items():
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        check_markdown_html(text, path.relative_to(root))
        linked.update(linked_files(text, path, allowed, root))
    return pages, notebooks, sorted(linked), table_of_contents(root)


#: What the marker says (the build knows its own marker by it).
MARKER_TEXT = "Built by tools/build_site.py, which empties src/ and html/ here on each build.\n"
#: The folders the build empties in its folder.
EMPTIED = ("src", "html", "_build")


def claim(out):
    """Make ``out`` the build folder, or refuse it (:class:`SiteError`) without touching it: it must
    be new, empty, or hold the :data:`MARKER` of an earlier build.

    Nothing the build writes or empties may be a symbolic link: writing the marker through a link
    would overwrite the file it points to, and emptying a linked ``src/`` or ``html/`` would empty
    a folder elsewhere. The marker must be a regular file of its own (no other hard link) with the text
    this script writes. Links inside ``src/`` and ``html/`` are removed, never followed."""
    if out.is_symlink():
        raise SiteError(f"--out {out} is a symbolic link: give the folder it points to, {out.resolve()}")
    if out.exists() and not out.is_dir():
        raise SiteError(f"--out {out} is a file, not a folder: choose a new folder for the site")
    marker = out / MARKER
    for path in (marker, *(out / name for name in EMPTIED)):
        if path.is_symlink():
            raise SiteError(f"--out {out}: {path.name} is a symbolic link (to {os.readlink(path)}), which the "
                            "build would write or empty through: remove the link yourself, or choose a new folder")
    if marker.exists() and not _regular_file_of_its_own(marker):
        raise SiteError(f"--out {out}: {MARKER} is not a regular file of its own (a folder, a device, or a "
                        "file with another name elsewhere, which writing the marker would change too): "
                        "this script did not make it; remove it yourself, or choose a new folder")
    for name in EMPTIED:
        if (out / name).exists() and not (out / name).is_dir():
            raise SiteError(f"--out {out}: {name} is not a folder, so this script did not make it: "
                            "choose a new or empty folder, or remove this one yourself")
    if out.is_dir() and any(out.iterdir()) and not _own_marker(marker):
        raise SiteError(f"--out {out} holds files this script did not write (it has no {MARKER} marker "
                        "it wrote): choose a new or empty folder, or remove this one yourself")
    out.mkdir(parents=True, exist_ok=True)
    # O_NOFOLLOW: a link planted after the checks above is refused, never written through.
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(MARKER_TEXT)


def _regular_file_of_its_own(path):
    """Whether ``path`` is a regular file (not a link, folder or device) with no other name (a hard
    link elsewhere would be written through like a symbolic one)."""
    try:
        status = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(status.st_mode) and status.st_nlink == 1


def _own_marker(marker):
    """Whether ``marker`` is a regular file of its own holding the text this script writes."""
    try:
        return _regular_file_of_its_own(marker) and marker.read_text() == MARKER_TEXT
    except (OSError, UnicodeDecodeError):
        return False


def stage(src, pages, notebooks, linked, toc, root=ROOT):
    """Write what the site shows into ``src``, laid out as in the repository."""
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)

    def target(path):
        out = src / path.relative_to(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        return out

    for page, text in pages.items():
        target(page).write_text(text)
    for path, nb in notebooks.items():
        nbformat.write(nb, target(path))
    for path in linked:
        if path.suffix.lower() == ".svg":
            target(path).write_text(clean_svg(path.read_text(), str(path.relative_to(root))))
        else:
            shutil.copy(path, target(path))
    shutil.copy(root / "docs" / "_config.yml", src / "_config.yml")
    import yaml
    (src / "_toc.yml").write_text(yaml.safe_dump(toc, sort_keys=False))
    shutil.copytree(root / "docs" / "_static", src / "_static")        # the site's style sheet
    (src / "_ext").mkdir()
    shutil.copy(root / "tools" / "site_navigation.py", src / "_ext" / "site_navigation.py")
    # MathJax without its SVG output (the site uses its HTML-CSS output and fonts).
    # Not under _static/: Jupyter Book would add every script there to every page.
    shutil.copytree(_mathjax(), src / "_mathjax" / "mathjax", ignore=shutil.ignore_patterns("SVG"))
    return src


def _missing_extras():
    """The ``site`` extra's packages that are not installed."""
    import importlib.util
    return [name for name, module in (("jupyter-book", "jupyter_book"), ("nh3", "nh3"),
                                      ("jupyter-server-mathjax", "jupyter_server_mathjax"))
            if importlib.util.find_spec(module) is None]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT,
                        help="build folder (default _build/site), new, empty or built by this script; "
                             "the site is its html/ folder")
    args = parser.parse_args(argv)
    out = pathlib.Path(os.path.abspath(args.out))     # not resolved: claim() refuses a link given as --out
    missing = _missing_extras()
    if missing:
        sys.exit(f"the site needs {', '.join(missing)}: pip install -e \".[site]\"")
    try:
        content = plan()
        claim(out)
    except SiteError as err:
        sys.exit(f"tools/build_site.py: {err}")
    src = stage(out / "src", *content)
    for name in ("html", "_build"):
        if (out / name).exists():
            shutil.rmtree(out / name)             # claim() refused these as links
    # -W: a warning (a broken link, a missing picture) fails the build instead of scrolling by.
    command = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build", str(src),
               "--path-output", str(out), "--builder", "html", "-W", "-n", "--keep-going"]
    print("building the course site (a minute or two) ...", flush=True)
    # Jupyter Book's own closing message names the folder it built in, which is moved below:
    # its output is shown only when the build fails.
    with tempfile.TemporaryFile("w+") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        if done.returncode:
            log.seek(0)
            sys.stdout.write(log.read())
            sys.exit(f"tools/build_site.py: Jupyter Book failed (exit {done.returncode}); its messages are above")
    shutil.move(out / "_build" / "html", out / "html")
    shutil.rmtree(out / "_build")
    html = out / "html"
    shown = os.path.relpath(html) if html.is_relative_to(pathlib.Path.cwd()) else str(html)
    print(f"course site: {html / 'index.html'}\n"
          f"serve it (search needs a server): python3 -m http.server -d {shown} 8000, then open http://localhost:8000/")
    return html


if __name__ == "__main__":
    main()
