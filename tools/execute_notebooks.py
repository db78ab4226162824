"""Execute the notebooks in place and store their outputs (used to record the GPU run).

Run from the repository root:  python tools/execute_notebooks.py [NOTEBOOK ...]
"""
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from canonical_notebooks import ROOT, canonical, text  # noqa: E402
from course_paths import course_notebooks  # noqa: E402


def main(paths):
    paths = [pathlib.Path(p).resolve() for p in paths] or course_notebooks(ROOT)
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        t0 = time.time()
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}, allow_errors=False,
                       record_timing=False).execute()
        path.write_text(text(canonical(nb)))
        print(f"executed {path.relative_to(ROOT)} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
