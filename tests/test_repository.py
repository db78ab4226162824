"""Keeps the repository itself honest: dependency lists agree, notebooks are canonical."""
import json
import pathlib
import re
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from course_paths import course_notebooks  # noqa: E402
NOTEBOOKS = course_notebooks(ROOT)


def _name(req):
    return re.split(r"[<>=!~ \[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in py["dependencies"]}
    for extra in ("test", "lab"):
        wanted |= {_name(r) for r in py["optional-dependencies"][extra]}
    text = (ROOT / "environment.yml").read_text()
    section = text.split("dependencies:", 1)[1]
    deps = [x.strip()[2:] for x in section.splitlines() if x.strip().startswith("- ") and "-e ." not in x]
    conda = {_name(d) for d in deps} - {"python", "pip", "pip:"}
    assert "cupy" in conda                       # conda's name for the cupy-cuda* wheels
    assert conda - {"cupy"} == wanted


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_canonical(path):
    import nbformat
    raw = path.read_text()
    nb = nbformat.reads(raw, as_version=4)
    nbformat.validate(nb)
    # Exactly what JupyterLab writes when ipykernel's kernel starts, or opening the notebook
    # marks it modified (and autosave rewrites it).
    from ipykernel.ipkernel import IPythonKernel
    from ipykernel.kernelspec import get_kernel_dict
    spec = get_kernel_dict()
    assert nb.metadata.get("kernelspec") == {"display_name": spec["display_name"], "language": spec["language"],
                                             "name": "python3"}
    kernel = dict(IPythonKernel.language_info)
    kernel.pop("version")                        # the Python that runs the kernel: not stored
    assert nb.metadata.get("language_info") == kernel
    assert "widgets" not in nb.metadata, "stray widget state saved in the notebook"
    for cell in nb.cells:
        assert "execution" not in cell.get("metadata", {}), "execution-timing metadata"
        assert "collapsed" not in cell.get("metadata", {}) or cell.cell_type == "code"
    # Every image link resolves.
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)", cell.source) + re.findall(r'<img[^>]+src="([^"]+)"', cell.source)
        for link in links:
            if link.startswith(("http://", "https://", "data:", "attachment:")):
                continue
            assert (path.parent / link).resolve().exists(), f"{path.name}: missing image {link}"
    # One canonical serialisation: what Jupyter's save writes (nbformat, then a newline).
    assert raw == nbformat.writes(nb) + "\n", \
        f"{path.name} is not saved in canonical nbformat form (run python tools/canonical_notebooks.py)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_metadata_names_no_interpreter(path):
    """Nothing stored names the Python that executed the notebook: a learner's JupyterLab,
    on another Python, would otherwise mark the notebook modified as it opens."""
    import nbformat
    nb = nbformat.read(path, as_version=4)

    def versions(node, where):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from versions(value, f"{where}.{key}")
        elif isinstance(node, str) and re.fullmatch(r"\d+\.\d+\.\d+\S*", node):
            yield f"{where} = {node}"

    found = list(versions(nb.metadata, "metadata"))
    for cell in nb.cells:
        found += versions(cell.metadata, f"cell {cell.get('id')} metadata")
    assert not found, f"{path.name} stores interpreter versions {found} (run python tools/canonical_notebooks.py)"
    assert "version" not in nb.metadata.get("language_info", {})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_only_the_public_surface(path):
    """A notebook imports the package as `ch` and reaches no private name through it. Showing a
    private function's source (``ch.show_code(...)``, e.g. the store's writer thread) is reading
    the code that runs, not using it, and is allowed."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    code = re.sub(r"\bch\.show_code\([^()]*\)", "", code)
    assert not re.findall(r"^\s*(?:from course_helper\b.*|import course_helper\.\S*)", code, re.M)
    assert not re.findall(r"\bch(?:\.[A-Za-z]\w*)*\._(?!_)\w+", code), "a private name of course_helper"


def test_the_package_namespace_is_its_short_public_list():
    import types

    import course_helper as ch
    public = {n for n in dir(ch) if not n.startswith("_") and not isinstance(getattr(ch, n), types.ModuleType)}
    assert public == set(ch.__all__), "names outside __all__ belong in their module"
    assert len(ch.__all__) <= 42                 # 40, the overlap doctor (ch.doctor) and a run's checked plan (ch.plan)
    page = (ROOT / "docs" / "helper-package.md").read_text()
    section = page.split("# The helper package", 1)[1].split("\n## ", 1)[0]
    for name in ch.__all__:
        assert f"`{name}" in section, f"docs/helper-package.md does not list {name}"
        if callable(getattr(ch, name)):
            assert getattr(ch, name).__doc__, f"{name} has no docstring"
    counted = re.search(r"\(`ch.__all__`, (\d+) of them\)", section)
    assert counted and int(counted.group(1)) == len(ch.__all__), \
        f"docs/helper-package.md should count the {len(ch.__all__)} names of ch.__all__"


def test_the_helper_package_page_names_only_names_that_exist():
    """Every ``ch.x`` or ``ch.module.x`` on docs/helper-package.md is reachable so, and a top-level
    ``ch.x`` is a public name (in ``ch.__all__``), not a module's name written as if it were one."""
    import course_helper as ch
    page = (ROOT / "docs" / "helper-package.md").read_text()
    for path in sorted(set(re.findall(r"\bch((?:\.[A-Za-z]\w*)+)", page))):
        parts = path.strip(".").split(".")
        obj = ch
        for part in parts:
            assert hasattr(obj, part), f"docs/helper-package.md names ch.{'.'.join(parts)}, which does not exist"
            obj = getattr(obj, part)
        if len(parts) == 1:
            assert parts[0] in ch.__all__, f"docs/helper-package.md names ch.{parts[0]}, not a top-level name"


def test_ci_runs_the_readme_test_command_with_the_browser_tests():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    tests = (ROOT / "docs" / "tests.md").read_text()
    learner = re.search(r'pip install -e "\.\[([a-z0-9,]+)\]" && (python3 -m pytest --nbval)', readme)
    contributor = re.search(r'pip install -e "\.\[([a-z0-9,]+)\]" && COURSE_E2E_REQUIRED=1 (python3 -m pytest --nbval)',
                            tests)
    assert learner and contributor, "the README's test command and docs/tests.md's"
    assert not {"e2e", "site"} & set(learner.group(1).split(",")), "the learner's install leaves the browsers out"
    assert set(contributor.group(1).split(",")) == set(learner.group(1).split(",")) | {"e2e", "site"}
    assert f'-e ".[{contributor.group(1)}]"' in ci
    assert contributor.group(2) in ci and "COURSE_E2E_REQUIRED=1" in ci and "apt-get install" in ci
    # CI builds the site with the README's command and hands it to the site's browser test.
    site = re.search(r"&& (python3 tools/build_site\.py)", readme)
    assert site and site.group(1) in ci and "COURSE_SITE_DIR" in ci


def test_readme_is_a_front_door_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    words = len(readme.split())
    print(f"README: {words} words")
    assert words <= 1300, f"the README has {words} words; details belong in docs/"
    toc = (ROOT / "docs" / "_toc.yml").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"the README does not link docs/{page.name}"
        assert f"file: docs/{page.stem}\n" in toc, f"the site's table of contents leaves out docs/{page.name}"
    # The notebooks are listed by the site build itself (tests/test_build_site.py checks that list).


def test_the_readme_results_table_is_the_committed_sweep():
    """The headline table is printed from benchmarks/bench.json, so it cannot drift from it."""
    import json
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    from results_table import headline_table
    table = headline_table(json.loads((ROOT / "benchmarks" / "bench.json").read_text()))
    assert table in (ROOT / "README.md").read_text()
    assert table in (ROOT / "docs" / "results.md").read_text()


def test_the_readme_two_gpu_table_is_the_committed_halo_benchmark():
    """The two-GPU table is printed from benchmarks/halo.json, in the README and docs/two-gpus.md."""
    import json
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    from results_table import halo_table
    doc = json.loads((ROOT / "benchmarks" / "halo.json").read_text())
    table = halo_table(doc)
    assert table in (ROOT / "README.md").read_text()
    assert table in (ROOT / "docs" / "two-gpus.md").read_text()
    one = next(p for p in doc["weak"] if p["ranks"] == 1 and p["n1"] == 2048)["strategies"]["blocking"]["ms"]
    assert f"| 2048² | {one:.1f} |" in table


def _anchor(heading):
    """The id a heading gets on GitHub and on the course site (MyST's heading anchors)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_into_the_glossary_reaches_one_of_its_words():
    """Notebooks and docs link a word at first use to docs/glossary.md#word: each such anchor is a
    heading of the glossary, so the link lands on the word's entry."""
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    words = {_anchor(h) for h in re.findall(r"^## (.+)$", glossary, re.M)}
    assert {"cupti", "clock", "happens-before", "ring-depth", "b", "modelled", "pinned-memory", "stream",
            "event", "copy-engine"} <= words
    import nbformat
    texts = {path.name: "\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                                   if c.cell_type == "markdown") for path in NOTEBOOKS}
    texts.update({path.name: path.read_text() for path in (ROOT / "docs").glob("*.md")})
    texts["README.md"] = (ROOT / "README.md").read_text()
    links = [(name, anchor) for name, text in texts.items()
             for anchor in re.findall(r"\]\((?:[./]*docs/)?glossary\.md#([^)\s]+)\)", text)
             + re.findall(r"\]\(#([^)\s]+)\)", text if name == "glossary.md" else "")]
    assert len(links) >= 10, "the notebooks link their words to the glossary"
    assert not [link for link in links if link[1] not in words], "links to no word of the glossary"


def test_the_launch_line_puts_an_absolute_folder_on_the_jupyter_config_path():
    """Kernels and terminals inherit JUPYTER_CONFIG_PATH: a relative folder would load the
    jupyter-config/ of whatever folder a later Jupyter runs in. Everywhere the course names it,
    it is the course's own folder, made absolute by the shell ("$PWD/jupyter-config")."""
    places = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
              *sorted((ROOT / "jupyter-config").glob("*.py"))]
    named = [(p.name, m.group(1)) for p in places
             for m in re.finditer(r'JUPYTER_CONFIG_PATH=("[^"]*"|[^\s`"]+)', p.read_text())]
    assert len([n for n in named if n[0] == "README.md"]) == 2 and len(named) >= 5, named
    assert all(value == '"$PWD/jupyter-config"' for _, value in named), named


def test_the_cpu_backend_page_quotes_the_profiles_disk_section():
    """docs/cpu-backend.md says what the H200 profile's disk section holds (the model runs on it)."""
    disk = json.loads((ROOT / "course_helper" / "profiles" / "h200.json").read_text())["disk"]
    text = (ROOT / "docs" / "cpu-backend.md").read_text().split("## The disk in the model", 1)[1]
    gbps, ms = re.search(r"([\d.]+) GB/s and ([\d.]+) ms per small fsync'ed\s+file", text).groups()
    assert float(gbps) == round(disk["gbps"], 2) and float(ms) == round(disk["latency_us"] / 1e3, 2)
    assert "same run as the rest of the profile" in text and "calibrate.measure_disk" in disk["provenance"]
