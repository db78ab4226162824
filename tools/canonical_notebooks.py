"""Save every notebook in one canonical form.

Run from the repository root:  python tools/canonical_notebooks.py [NOTEBOOK ...]

It keeps outputs (the stored GPU run) but drops what changes from run to run
without meaning anything: widget state, execution timing, the kernel's
display name. tests/test_repository.py checks that notebooks stay this way.
"""
import pathlib
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def canonical(nb):
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata.setdefault("language_info", {"name": "python"})
    nb.metadata["language_info"] = {"name": "python"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("collapsed", None)
        cell.metadata.pop("scrolled", None)
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                out.get("metadata", {}).pop("execution", None)
    return nb


def main(paths):
    paths = [pathlib.Path(p).resolve() for p in paths] or sorted((ROOT / "notebooks").rglob("*.ipynb"))
    for path in paths:
        nb = canonical(nbformat.read(path, as_version=4))
        nbformat.validate(nb)
        text = nbformat.writes(nb)
        if path.read_text() != text:
            path.write_text(text)
            print("rewrote", path.relative_to(ROOT))


if __name__ == "__main__":
    main(sys.argv[1:])
