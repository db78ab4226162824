"""Save every notebook in one canonical form.

Run from the repository root:  python tools/canonical_notebooks.py [NOTEBOOK ...]

It keeps outputs (the stored GPU run) but drops what changes from run to run
without meaning anything: widget state, execution timing. The notebook's
metadata is what JupyterLab writes when it starts ipykernel's ``python3``
kernel (kernelspec and language_info) less anything that names the Python
that ran it (language_info's version), and the file ends with the
newline Jupyter's save adds: otherwise opening a notebook marks it modified at
once, and autosave rewrites it. tests/test_repository.py checks that notebooks
stay this way.
"""
import pathlib
import sys

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from course_paths import ROOT, course_notebooks  # noqa: E402


# What ipykernel's kernelspec and kernel_info reply say; JupyterLab copies both into the
# notebook when the kernel starts. language_info's "version" (the Python that ran the
# stored outputs) is left out: it would differ from a learner's Python and mark every
# notebook modified on opening. The course's JupyterLab settings (jupyter-config/) fill it
# in with the server's own Python when a notebook opens and drop it again when one is saved.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3"}


def canonical(nb):
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = dict(LANGUAGE_INFO)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("collapsed", None)
        cell.metadata.pop("scrolled", None)
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                out.get("metadata", {}).pop("execution", None)
    return nb


def text(nb):
    """The notebook as Jupyter's own save writes it (nbformat.write ends the file with a newline)."""
    return nbformat.writes(nb) + "\n"


def main(paths):
    paths = [pathlib.Path(p).resolve() for p in paths] or course_notebooks(ROOT)
    for path in paths:
        nb = canonical(nbformat.read(path, as_version=4))
        nbformat.validate(nb)
        new = text(nb)
        if path.read_text() != new:
            path.write_text(new)
            print("rewrote", path.relative_to(ROOT))


if __name__ == "__main__":
    main(sys.argv[1:])
