"""The course's notebooks as files: one home for "every notebook under notebooks/".

Folders whose name starts with a dot are not the course's: JupyterLab saves a checkpoint copy of
each notebook it opens as ``notebooks/.ipynb_checkpoints/NAME-checkpoint.ipynb``, and a copy there
is neither a lesson nor a solution (pytest's own collection leaves such folders out too, by its
default ``norecursedirs``). The tests and the tools (tools/canonical_notebooks.py,
tools/execute_notebooks.py) take the notebooks from here.
"""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def hidden(path, root=ROOT):
    """Whether ``path`` lies in (or is) a file or folder whose name starts with a dot, below ``root``."""
    return any(part.startswith(".") for part in pathlib.Path(path).relative_to(root).parts)


def course_notebooks(root=ROOT):
    """Every notebook of the course under ``root/notebooks`` (lessons and solutions), sorted;
    none from a hidden folder (``.ipynb_checkpoints``)."""
    return sorted(p for p in (pathlib.Path(root) / "notebooks").rglob("*.ipynb") if not hidden(p, root))
