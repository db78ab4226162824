"""JupyterLab settings shipped with the course.

The README's launch line puts this folder on JUPYTER_CONFIG_PATH:

    JUPYTER_CONFIG_PATH="$PWD/jupyter-config" jupyter lab notebooks/01_setup_and_device.ipynb

It adds to your own Jupyter configuration: your settings (~/.jupyter) still apply, and
JupyterLab settings you change yourself win over the defaults set here.
"""
import pathlib
import sys

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

HERE = pathlib.Path(__file__).resolve().parent

# Serve the whole course, not just the folder of the notebook you open, so that the
# notebooks' ../images/*.svg links resolve.
c.ServerApp.root_dir = str(HERE.parent)  # noqa: F821 - c is traitlets' config

# Give the kernel CurveZMQ keys (ipykernel supports them), so its traffic with the server is
# encrypted and it does not warn that it runs "over TCP without encryption".
c.KernelManager.transport_encryption = "auto"  # noqa: F821

# No news feed, no update check, and no pop-up asking about either. The server's setting stops
# the feed; the front end still asks "Would you like to get notified about official Jupyter
# news?" while its own setting fetchNews is "none" (its default), so lab-settings/overrides.json
# makes "false" (Never) the default. JupyterLab reads default overrides from one folder,
# app_settings_dir (share/jupyter/lab/settings, which a pip install leaves empty).
c.LabApp.news_url = None  # noqa: F821
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"  # noqa: F821
c.LabApp.app_settings_dir = str(HERE / "lab-settings")  # noqa: F821


# The stored notebooks name no Python version (tools/canonical_notebooks.py leaves it out, so
# that they do not depend on the Python that ran them). When a kernel starts, JupyterLab
# copies the kernel's language_info, version included, into the notebook, and any change
# marks the notebook modified. So a notebook opens with this Python's version filled in
# (ipykernel's python3 kernel runs the server's own Python and reports sys.version's first
# word), and is saved without it: opening one changes nothing, on any Python.
def drop_python_version(model, **kwargs):
    """Save notebooks without the Python version, as they are stored."""
    if model.get("type") == "notebook" and model.get("content"):
        model["content"].get("metadata", {}).get("language_info", {}).pop("version", None)


class CourseContentsManager(AsyncLargeFileManager):
    """Jupyter Server's default contents manager, with language_info's version filled in on
    opening and dropped on saving."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # Registered here rather than set as the pre_save_hook option: the server applies its
        # configuration more than once, and each time after the first, setting that option
        # warns "Overriding existing pre_save_hook" at every start. A user's own
        # pre_save_hook still runs, before this one.
        self.register_pre_save_hook(drop_python_version)

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and model.get("content"):
            info = model["content"].get("metadata", {}).get("language_info")
            if isinstance(info, dict) and info.get("name") == "python":
                info.setdefault("version", sys.version.split()[0])
        return model


c.ServerApp.contents_manager_class = CourseContentsManager  # noqa: F821
