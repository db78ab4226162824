"""The launch line's settings (jupyter-config/): the contents manager they install opens a stored
notebook with this Python's version filled in and saves it without, and loading them warns about
nothing (the server applies its configuration more than once)."""
import asyncio
import pathlib
import sys
import warnings

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def config():
    pytest.importorskip("jupyter_server", reason="pip install jupyterlab (the lab extra)")
    from traitlets.config.loader import PyFileConfigLoader
    return PyFileConfigLoader("jupyter_server_config.py", path=str(ROOT / "jupyter-config")).load_config()


def test_loading_the_settings_twice_warns_about_nothing(config, tmp_path):
    manager_class = config.ServerApp.contents_manager_class
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager = manager_class(config=config, root_dir=str(tmp_path))
        manager.update_config(config)          # what an extension's loading does to the server's config
    assert not [str(w.message) for w in caught]


def test_a_notebook_opens_with_the_python_version_and_is_saved_without_it(config, tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A lesson")])
    nb.metadata["language_info"] = {"name": "python"}
    (tmp_path / "lesson.ipynb").write_text(nbformat.writes(nb))
    manager = config.ServerApp.contents_manager_class(config=config, root_dir=str(tmp_path))

    async def open_and_save():
        model = await manager.get("lesson.ipynb")
        assert model["content"]["metadata"]["language_info"]["version"] == sys.version.split()[0]
        await manager.save(model, "lesson.ipynb")

    asyncio.run(open_and_save())
    saved = nbformat.read(tmp_path / "lesson.ipynb", as_version=4)
    assert saved.metadata["language_info"] == {"name": "python"}
