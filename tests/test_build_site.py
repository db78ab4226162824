"""The site build's own rules (tools/build_site.py), without building a site: the course's order,
the folder it may write into, the HTML allow-list, the files a page may publish, what it prints.
(tests/e2e/test_site.py opens a built site in Chromium.)"""
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_site  # noqa: E402
from course_paths import course_notebooks  # noqa: E402


def _nh3():
    pytest.importorskip("nh3", reason='the site\'s HTML sanitiser: pip install -e ".[site]"')


def _site_extra():
    missing = build_site._missing_extras()
    if missing:
        pytest.skip(f'the site needs {", ".join(missing)}: pip install -e ".[site]"')


def _yaml():
    pytest.importorskip("yaml", reason='the site\'s table of contents is YAML: pip install -e ".[site]"')


def _notebook(path, title, markdown=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\n{markdown}")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    return path


def _course(root, lessons, solutions):
    for name in lessons:
        _notebook(root / "notebooks" / f"{name}.ipynb", name.split("_", 1)[1].replace("_", " "))
    for name in solutions:
        _notebook(root / "notebooks" / "solutions" / f"{name}.ipynb", "whatever the exercise was called")
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "_toc.yml").write_text((ROOT / "docs" / "_toc.yml").read_text())
    return root


# -- the course's order -----------------------------------------------------------------------------

def test_the_course_part_lists_every_lesson_by_number_with_its_solutions_under_it(tmp_path):
    _yaml()
    root = _course(tmp_path, ["13_capstone", "02_streams", "10_limit", "01_setup", "11_disk"],
                   ["13_capstone_solution", "02_streams_solution", "10_layer_cake_graph_solution"])
    toc = build_site.table_of_contents(root)
    (part,) = [p for p in toc["parts"] if p["caption"] == build_site.COURSE_PART]
    assert part["chapters"] == [
        {"file": "notebooks/01_setup"},
        {"file": "notebooks/02_streams", "sections": [{"file": "notebooks/solutions/02_streams_solution"}]},
        {"file": "notebooks/10_limit", "sections": [{"file": "notebooks/solutions/10_layer_cake_graph_solution"}]},
        {"file": "notebooks/11_disk"},
        {"file": "notebooks/13_capstone", "sections": [{"file": "notebooks/solutions/13_capstone_solution"}]}]
    assert [p["caption"] for p in toc["parts"]][-1] == "Reference"


def test_the_course_s_own_table_of_contents_holds_every_notebook_and_page():
    _yaml()
    toc = build_site.table_of_contents()
    files = re.findall(r"'file': '([^']+)'", str(toc))
    for path in course_notebooks(ROOT):
        assert path.relative_to(ROOT).with_suffix("").as_posix() in files
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.stem}" in files
    assert len(files) == len(set(files))


def test_a_solution_that_answers_no_lesson_stops_the_build(tmp_path):
    root = _course(tmp_path, ["01_setup"], ["04_wave_solution"])
    with pytest.raises(build_site.SiteError, match="04_wave_solution.ipynb answers no lesson"):
        build_site.course(root)


def test_solutions_are_titled_after_their_lesson_and_linked_from_it():
    _nh3()
    pages, notebooks, _, _ = build_site.plan()
    for lesson, solutions in build_site.course():
        lesson_title = build_site.title(notebooks[lesson])
        for path in solutions:
            assert build_site.title(notebooks[path]) == f"Solution: {lesson_title}"
            assert f"](solutions/{path.name})" in notebooks[lesson].cells[-1].source
    assert ROOT / "README.md" in pages


# -- the build folder ---------------------------------------------------------------------------------

def test_the_build_writes_only_into_a_new_an_empty_or_its_own_folder(tmp_path):
    new = tmp_path / "new" / "site"
    build_site.claim(new)
    assert (new / build_site.MARKER).is_file()
    build_site.claim(new)                                   # its own, again
    empty = tmp_path / "empty"
    empty.mkdir()
    build_site.claim(empty)
    assert (empty / build_site.MARKER).is_file()


def test_a_folder_the_build_did_not_make_is_refused_before_anything_is_touched(tmp_path, capsys):
    foreign = tmp_path / "notes"
    (foreign / "src").mkdir(parents=True)
    (foreign / "src" / "mine.txt").write_text("keep me")
    (foreign / "html").mkdir()
    before = sorted((p.relative_to(foreign), p.stat().st_mtime_ns) for p in foreign.rglob("*"))
    with pytest.raises(build_site.SiteError, match=r"holds files this script did not write.*choose a new or empty"):
        build_site.claim(foreign)
    assert sorted((p.relative_to(foreign), p.stat().st_mtime_ns) for p in foreign.rglob("*")) == before
    assert (foreign / "src" / "mine.txt").read_text() == "keep me"
    a_file = tmp_path / "site.txt"
    a_file.write_text("a file")
    with pytest.raises(build_site.SiteError, match="is a file, not a folder"):
        build_site.claim(a_file)
    assert a_file.read_text() == "a file"


def _fake_jupyter_book(monkeypatch, says=None):
    """Stand in for Jupyter Book: a build writes one index.html where it was told, and prints ``says``
    (``{built}``: the folder it built in) to the output it was given; git still answers for real."""
    run = subprocess.run

    def jupyter_book(command, **kwargs):
        if "--path-output" not in command:              # git, asked which files are the course's
            return run(command, **kwargs)
        built = pathlib.Path(command[command.index("--path-output") + 1]) / "_build" / "html"
        built.mkdir(parents=True)
        (built / "index.html").write_text("<html></html>")
        if says is not None:
            kwargs["stdout"].write(says.format(built=built))
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(build_site.subprocess, "run", jupyter_book)


def _tree(folder):
    """Every path under ``folder`` (links not followed) with its last change, to see nothing changed."""
    return sorted((p.relative_to(folder), os.lstat(p).st_mtime_ns) for p in folder.rglob("*"))


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_marker_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, monkeypatch):
    """A planted ``.course-site`` link would have the build write through it (and then empty the
    folder's src/ and html/): refused, by claim() and by the command, before any file is written."""
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("someone's notes")
    out = tmp_path / "site"
    (out / "src").mkdir(parents=True)
    (out / "src" / "mine.txt").write_text("keep me")
    (out / build_site.MARKER).symlink_to(elsewhere)
    before = _tree(out)
    with pytest.raises(build_site.SiteError, match=r"\.course-site is a symbolic link.*remove the link yourself"):
        build_site.claim(out)
    monkeypatch.setattr(build_site, "_missing_extras", lambda: [])   # the refusal needs no extra
    monkeypatch.setattr(build_site, "plan", lambda: None)
    with pytest.raises(SystemExit, match="is a symbolic link"):
        build_site.main(["--out", str(out)])
    assert elsewhere.read_text() == "someone's notes"
    assert _tree(out) == before and (out / "src" / "mine.txt").read_text() == "keep me"


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
@pytest.mark.parametrize("name", ["src", "html", "_build"])
def test_a_built_folder_whose_src_or_html_is_a_link_is_refused(tmp_path, name):
    """Even in the build's own folder (its marker is real), a linked src/ or html/ would have the
    build empty the folder it points to."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "thesis.tex").write_text("keep me")
    out = tmp_path / "site"
    build_site.claim(out)                                   # a real build folder, marker and all
    (out / name).symlink_to(elsewhere, target_is_directory=True)
    before = _tree(out)
    with pytest.raises(build_site.SiteError, match=rf"{name} is a symbolic link"):
        build_site.claim(out)
    assert _tree(out) == before and (elsewhere / "thesis.tex").read_text() == "keep me"


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_an_out_folder_given_as_a_link_is_refused_and_what_it_points_to_untouched(tmp_path, monkeypatch):
    """The command does not follow a link given as --out to build in the folder it points to."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "site"
    link.symlink_to(elsewhere, target_is_directory=True)
    monkeypatch.setattr(build_site, "_missing_extras", lambda: [])
    monkeypatch.setattr(build_site, "plan", lambda: None)
    with pytest.raises(SystemExit, match=r"site is a symbolic link: give the folder it points to"):
        build_site.main(["--out", str(link)])
    assert list(elsewhere.iterdir()) == []


def test_a_marker_the_build_did_not_write_or_a_src_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "site"
    out.mkdir()
    (out / build_site.MARKER).write_text("my own notes, not a build's marker")
    with pytest.raises(build_site.SiteError, match="no .course-site marker it wrote"):
        build_site.claim(out)
    assert (out / build_site.MARKER).read_text() == "my own notes, not a build's marker"
    built = tmp_path / "built"
    build_site.claim(built)
    (built / "html").write_text("a file")
    with pytest.raises(build_site.SiteError, match="html is not a folder"):
        build_site.claim(built)
    assert (built / "html").read_text() == "a file"


def test_a_marker_that_is_a_folder_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "site"
    (out / build_site.MARKER).mkdir(parents=True)
    (out / build_site.MARKER / "notes.txt").write_text("keep me")
    before = _tree(out)
    with pytest.raises(build_site.SiteError, match=r"\.course-site is not a regular file of its own"):
        build_site.claim(out)
    assert _tree(out) == before and (out / build_site.MARKER / "notes.txt").read_text() == "keep me"


@pytest.mark.skipif(not hasattr(os, "link"), reason="needs hard links")
def test_a_marker_with_another_name_elsewhere_is_refused_and_that_file_untouched(tmp_path):
    """A hard link holding the marker's own text would be truncated and written through like a
    symbolic one (and its folder's src/ and html/ emptied): a marker must have no other name."""
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text(build_site.MARKER_TEXT)
    out = tmp_path / "site"
    out.mkdir()
    os.link(elsewhere, out / build_site.MARKER)
    before = os.stat(elsewhere).st_mtime_ns
    with pytest.raises(build_site.SiteError, match="not a regular file of its own"):
        build_site.claim(out)
    assert os.stat(elsewhere).st_mtime_ns == before and elsewhere.read_text() == build_site.MARKER_TEXT


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_rebuild_removes_links_inside_src_and_html_never_what_they_point_to(tmp_path, monkeypatch):
    """The build empties src/ and html/ of its own folder: a link planted inside them (to a file or
    a folder elsewhere) goes, and what it points to stays as it was."""
    _site_extra()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "folder").mkdir(parents=True)
    (elsewhere / "folder" / "thesis.tex").write_text("keep me")
    (elsewhere / "notes.txt").write_text("keep me too")
    out = tmp_path / "site"
    build_site.claim(out)
    for name in ("src", "html"):
        (out / name / "deeper").mkdir(parents=True)
        (out / name / "to-a-folder").symlink_to(elsewhere / "folder", target_is_directory=True)
        (out / name / "deeper" / "to-a-file").symlink_to(elsewhere / "notes.txt")
    before = _tree(elsewhere)
    _fake_jupyter_book(monkeypatch)
    build_site.main(["--out", str(out)])
    assert _tree(elsewhere) == before
    assert (elsewhere / "folder" / "thesis.tex").read_text() == "keep me"
    assert (elsewhere / "notes.txt").read_text() == "keep me too"
    assert not any(p.is_symlink() for name in ("src", "html") for p in (out / name).rglob("*"))


def test_the_build_command_refuses_a_folder_it_did_not_make_and_leaves_it_alone(tmp_path):
    _site_extra()                                  # the command checks its extra first, then the folder
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    before = sorted((p.relative_to(foreign), p.stat().st_mtime_ns) for p in foreign.rglob("*"))
    with pytest.raises(SystemExit) as stopped:
        build_site.main(["--out", str(foreign)])
    assert str(foreign) in str(stopped.value.code) and "did not write" in str(stopped.value.code)
    assert sorted((p.relative_to(foreign), p.stat().st_mtime_ns) for p in foreign.rglob("*")) == before
    assert (foreign / "mine.txt").read_text() == "keep me"


def test_a_missing_dependency_stops_the_build_before_the_folder_is_touched(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(build_site, "_missing_extras", lambda: ["jupyter-book"])
    with pytest.raises(SystemExit, match=r'needs jupyter-book: pip install -e "\.\[site\]"'):
        build_site.main(["--out", str(out)])
    assert not out.exists()


def test_the_build_prints_one_path_and_not_jupyter_book_s_own(tmp_path, monkeypatch, capsys):
    """Jupyter Book's closing message names the folder it built in, which the build then moves:
    only the build's own line, with the site's real place, is printed."""
    _nh3()
    out = tmp_path / "site"
    _fake_jupyter_book(monkeypatch, says="Or paste this line directly into your browser bar:\n    file://{built}/index.html\n")
    html = build_site.main(["--out", str(out)])
    printed = capsys.readouterr().out
    assert html == out / "html" and (html / "index.html").is_file()
    assert "paste this line" not in printed and "/_build/" not in printed
    assert f"course site: {html / 'index.html'}" in printed
    assert f"python3 -m http.server -d {html} 8000" in printed
    assert (out / "src" / "_toc.yml").is_file() and (out / build_site.MARKER).is_file()


# -- the HTML allow-list -------------------------------------------------------------------------------

#: Every way a script, an event handler or a load from another host may hide in an HTML output.
HOSTILE_HTML = [
    "<SCRIPT>alert(1)</SCRIPT>",
    "<ScRiPt src='x.js'></sCrIpT>",
    "<img src=x onerror=alert(1)>",
    "<IMG SRC=x ONERROR='alert(1)'>",
    "<svg onload=alert(1)></svg>",
    "<svg><script>alert(1)</script></svg>",
    "<div onclick='alert(1)'>x</div>",
    "<a href='javascript:alert(1)'>x</a>",
    "<a href=' JaVaScRiPt:alert(1)'>x</a>",
    "<iframe src='https://example.org'></iframe>",
    "<object data='x.swf'></object>",
    "<style>body{background:url(https://example.org/x.png)}</style>",
    "<img src='https://example.org/pixel.png'>",
    "<img src='//example.org/pixel.png'>",
    "<a href='data:text/html,<script>alert(1)</script>'>x</a>",
    "<math><mi xlink:href='javascript:alert(1)'>x</mi></math>",
]


def test_no_script_handler_or_remote_load_survives_the_sanitiser():
    _nh3()
    for html in HOSTILE_HTML:
        cleaned = build_site.clean_html(f"<p>before</p>{html}<p>after</p>").lower()
        assert "<p>before</p>" in cleaned and "<p>after</p>" in cleaned, (html, cleaned)
        for trace in ("<script", "onerror", "onload", "onclick", "javascript:", "<iframe", "<object", "<svg",
                      "<style", "example.org", "data:text"):
            assert trace not in cleaned, (html, cleaned)


def test_the_sanitiser_keeps_tables_text_and_inline_pictures():
    _nh3()
    html = ('<table class="dataframe"><thead><tr><th colspan="2">ms</th></tr></thead>'
            '<tbody><tr><td>1.5</td><td style="text-align: right">2</td></tr></tbody></table>'
            '<details><summary>Hint</summary><code>x</code></details>'
            '<img src="data:image/png;base64,iVBORw0KGgo=" alt="a picture"><a href="https://cupy.dev">CuPy</a>'
            '<img src="../images/diagram.png">')
    cleaned = build_site.clean_html(html)
    for kept in ('<th colspan="2">ms</th>', '<td style="text-align:right">2</td>', "<summary>Hint</summary>",
                 'src="data:image/png;base64,iVBORw0KGgo="', 'href="https://cupy.dev"', 'src="../images/diagram.png"'):
        assert kept in cleaned, (kept, cleaned)


#: Every way a script or a load from another host may hide in an SVG picture.
HOSTILE_SVG = [
    '<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)"><path d="M 0 0 L 1 1"/></svg>',
    '<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script><path d="M 0 0 L 1 1"/></svg>',
    '<svg xmlns="http://www.w3.org/2000/svg"><SCRIPT type="text/ecmascript">alert(1)</SCRIPT>'
    '<path d="M 0 0 L 1 1"/></svg>',
    '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
    '<a xlink:href="javascript:alert(1)"><path d="M 0 0 L 1 1"/></a></svg>',
    '<svg xmlns="http://www.w3.org/2000/svg"><path d="M 0 0 L 1 1"/>'
    '<foreignObject><iframe src="https://example.org"/></foreignObject></svg>',
    '<svg xmlns="http://www.w3.org/2000/svg"><set attributeName="onmouseover" to="alert(1)"/>'
    '<path d="M 0 0 L 1 1"/></svg>',
    '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
    '<use xlink:href="https://example.org/x.svg#a"/><path d="M 0 0 L 1 1"/></svg>',
]


def test_scripts_inside_svg_never_reach_the_site():
    _nh3()
    for svg in HOSTILE_SVG:
        cleaned = build_site.clean_svg(svg)
        lowered = cleaned.lower()
        for trace in ("script", "onload", "javascript:", "foreignobject", "iframe", "example.org", "<set", "<a "):
            assert trace not in lowered, (svg, cleaned)
        root = ElementTree.fromstring(cleaned)            # still an SVG file a browser opens
        assert root.tag == "{http://www.w3.org/2000/svg}svg" and len(root.findall(".//{*}path")) == 1, cleaned


def test_the_course_s_diagrams_keep_every_shape_through_the_sanitiser():
    _nh3()
    pictures = sorted((ROOT / "images").glob("*.svg"))
    assert pictures
    for picture in pictures:
        text = picture.read_text()
        cleaned = ElementTree.fromstring(build_site.clean_svg(text, picture.name))
        original = ElementTree.fromstring(text.encode())
        for shape in ("path", "use", "clipPath", "rect", "g"):
            assert len(cleaned.findall(f".//{{*}}{shape}")) == len(original.findall(f".//{{*}}{shape}")), \
                (picture.name, shape)
        assert cleaned.get("viewBox") == original.get("viewBox"), picture.name


def test_outputs_reach_the_page_sanitised_and_scripts_as_a_note():
    _nh3()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("display_data", data={"text/html": "<b>ok</b><SCRIPT>alert(1)</SCRIPT>"}),
        nbformat.v4.new_output("display_data", data={"image/svg+xml": '<svg xmlns="http://www.w3.org/2000/svg" '
                                                                      'onload="alert(1)"><path d="M0 0"/></svg>'}),
        nbformat.v4.new_output("display_data", data={"application/javascript": "alert(1)"})])])
    html, svg, note = build_site.static_outputs(nb).cells[0].outputs
    assert html["data"]["text/html"] == "<b>ok</b>"
    assert "onload" not in svg["data"]["image/svg+xml"] and "<path" in svg["data"]["image/svg+xml"]
    assert note["data"] == {"text/markdown": build_site.NEEDS_SCRIPT}


def test_a_page_s_own_html_beyond_the_allow_list_stops_the_build():
    pytest.importorskip("markdown_it", reason='Jupyter Book\'s markdown parser: pip install -e ".[site]"')
    fine = ("<details><summary>Hint 1</summary>\n\nText with `<script>` in code, and <code>x</code>.\n\n"
            "</details>\n\n```html\n<script>alert(1)</script>\n```\n")
    build_site.check_markdown_html(fine, "notebooks/ok.ipynb")
    for bad, named in [("<img src=x onerror=alert(1)>", "onerror"), ("<SCRIPT>alert(1)</SCRIPT>", "<script>"),
                       ("<svg onload=alert(1)></svg>", "<svg>"), ('<a href="javascript:alert(1)">x</a>', "javascript"),
                       ('<img src="https://example.org/p.png">', "example.org")]:
        with pytest.raises(build_site.SiteError, match=f"notebooks/bad.ipynb uses HTML.*{re.escape(named)}"):
            build_site.check_markdown_html(f"Some text {bad} more.\n", "notebooks/bad.ipynb")


def test_the_course_s_pages_pass_the_allow_list():
    _nh3()
    pytest.importorskip("markdown_it", reason='Jupyter Book\'s markdown parser: pip install -e ".[site]"')
    build_site.plan()                 # raises SiteError naming the page where one does not


# -- the files a page may publish -----------------------------------------------------------------------

def _git_course(root):
    """A course folder under git, with a picture, a page linking it, a secret and an ignored file."""
    (root / "images").mkdir(parents=True)
    (root / "images" / "ring.png").write_bytes(b"\x89PNG")
    (root / "docs").mkdir()
    (root / ".gitignore").write_text("/_build/\n")
    (root / "_build").mkdir()
    (root / "_build" / "old.txt").write_text("built")
    for args in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    (root / ".git" / "config").write_text((root / ".git" / "config").read_text() + "# a secret\n")
    return root


def test_pages_publish_only_files_of_the_course(tmp_path):
    root = _git_course(tmp_path)
    allowed = build_site.course_files(root)
    assert root / "images" / "ring.png" in allowed and root / ".git" / "config" not in allowed
    page = root / "docs" / "page.md"
    assert list(build_site.linked_files("![ring](../images/ring.png)", page, allowed, root)) == \
        [root / "images" / "ring.png"]
    for link in ("[config](../.git/config)", '<img src="../.git/config">', "[built](../_build/old.txt)",
                 "[passwd](../../../../../../etc/passwd)"):
        with pytest.raises(build_site.SiteError, match="docs/page.md links to .*not a file of the course"):
            list(build_site.linked_files(link, page, allowed, root))


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_symbolic_link_out_of_the_course_publishes_nothing(tmp_path):
    root = _git_course(tmp_path / "course")
    (tmp_path / "secret.txt").write_text("secret")
    (root / "images" / "innocent.png").symlink_to(tmp_path / "secret.txt")
    (root / "images" / "config.png").symlink_to(root / ".git" / "config")
    subprocess.run(["git", "add", "-A"], cwd=root, check=True, capture_output=True)
    allowed = build_site.course_files(root)
    for name in ("innocent.png", "config.png"):
        with pytest.raises(build_site.SiteError, match="never through a symbolic link"):
            list(build_site.linked_files(f"![x](../images/{name})", root / "docs" / "page.md", allowed, root))


def test_outside_a_git_checkout_the_course_is_every_file_but_git_s_and_the_builds(tmp_path):
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "run").write_text("#!/bin/sh")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("a secret")
    (tmp_path / "_build" / "site").mkdir(parents=True)
    (tmp_path / "_build" / "site" / "old.html").write_text("built")
    assert build_site.course_files(tmp_path) == {tmp_path / ".ci" / "run"}
