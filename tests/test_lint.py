"""ruff finds nothing in the package, the tests, the benchmarks and the tools, with the rules
pyproject.toml's [tool.ruff] selects (pycodestyle, pyflakes, bugbear, blind except)."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED = ["course_helper", "tests", "benchmarks", "tools", "conftest.py"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                                reason="ruff is not installed (it comes with the test extra: pip install -e '.[test]')")


def _ruff(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    done = _ruff(*CHECKED)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_uses_the_project_rules(tmp_path):
    """The configuration is the one the check above reads, and it does report what it selects."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(x=[]):\n    try:\n        return x\n    except Exception:\n"
                   "        return None\n")
    done = _ruff("--config", str(ROOT / "pyproject.toml"), "--output-format", "concise", str(bad), cwd=tmp_path)
    assert done.returncode == 1
    for code in ("F401", "B006", "BLE001"):
        assert code in done.stdout, done.stdout
