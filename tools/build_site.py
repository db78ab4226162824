"""Build the course site: the README, docs/ and the notebooks as static HTML.

Run from the repository root (needs the ``site`` extra: pip install -e ".[site]"):

    python3 tools/build_site.py            # the site lands in _build/site/html/index.html

Jupyter Book 1.x builds it from the notebooks' stored outputs (nothing is executed), with
docs/_toc.yml (the course map) as the table of contents and docs/_config.yml as its settings.
The build works on a copy of the course (_build/site/src) in which:

- each slice widget's stored output keeps only its still picture, with a note saying how to
  get the live slider (a static page has no kernel to move it);
- any stored output that needs JavaScript to show (a script in HTML, e.g. an animation from
  an older run) is replaced by a note saying how to see it;
- MathJax comes from the jupyter-server-mathjax package and is served with the site, so
  viewing the site fetches nothing from another host;
- every file the pages link to (benchmark results, profiles, scripts) is copied along, so
  the links work on the site too.
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "_build" / "site"
WIDGET = "application/vnd.jupyter.widget-view+json"
LIVE_SLIDER = ("*On this page: a still picture of the slice the stored run showed. The live slider and "
               "play button need a running kernel: open the notebook in JupyterLab (README, Quick start) "
               "and run it.*")
NEEDS_SCRIPT = ("*This output needs JavaScript that a static page does not run. Open the notebook in "
                "JupyterLab (README, Quick start) and run the cell to see it.*")
# The pages' relative links: [text](target) and <img src="target">.
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)|src=\"([^\"#]+)\"")


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
            elif "application/javascript" in data or "<script" in data.get("text/html", ""):
                outputs.append(_note(NEEDS_SCRIPT))
            else:
                outputs.append(out)
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return nb


def _linked_files(text, page):
    """Files of the repository that a page links to (not pages, not web addresses)."""
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target) or target.endswith((".md", ".ipynb")):
            continue
        path = (page.parent / target).resolve()
        if path.is_file() and ROOT in path.parents:
            yield path


def _mathjax():
    """MathJax 2's files from the jupyter-server-mathjax package (Jupyter's own offline copy)."""
    try:
        import jupyter_server_mathjax
    except ImportError:
        sys.exit("the site needs jupyter-server-mathjax (MathJax served with the site): pip install -e \".[site]\"")
    return pathlib.Path(jupyter_server_mathjax.__file__).parent / "static"


def stage(src):
    """Copy what the site shows into ``src``, laid out as in the repository."""
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    notebooks = sorted((ROOT / "notebooks").rglob("*.ipynb"))
    for page in pages:
        (src / page.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, src / page.relative_to(ROOT))
    for path in notebooks:
        target = src / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(static_outputs(nbformat.read(path, as_version=4)), target)
    linked = set()
    for page in pages:
        linked.update(_linked_files(page.read_text(), page))
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        linked.update(_linked_files("\n".join(c.source for c in nb.cells if c.cell_type == "markdown"), path))
    for path in sorted(linked):
        target = src / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    for name in ("_config.yml", "_toc.yml"):
        shutil.copy(ROOT / "docs" / name, src / name)
    # MathJax without its SVG output (the site uses its HTML-CSS output and fonts).
    # Not under _static/: Jupyter Book would add every script there to every page.
    shutil.copytree(_mathjax(), src / "_mathjax" / "mathjax", ignore=shutil.ignore_patterns("SVG"))
    return src


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT,
                        help="build folder (default _build/site); the site is its html/ folder")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    src = stage(out / "src")
    if (out / "html").exists():
        shutil.rmtree(out / "html")
    # -W: a warning (a broken link, a missing picture) fails the build instead of scrolling by.
    command = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build", str(src),
               "--path-output", str(out), "--builder", "html", "-W", "-n", "--keep-going"]
    subprocess.run(command, check=True)
    shutil.move(out / "_build" / "html", out / "html")
    shutil.rmtree(out / "_build")
    print(f"course site: {out / 'html' / 'index.html'}")
    return out / "html"


if __name__ == "__main__":
    main()
