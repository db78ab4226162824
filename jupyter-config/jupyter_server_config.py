"""JupyterLab settings shipped with the course.

The README's launch line puts this folder on JUPYTER_CONFIG_PATH:

    JUPYTER_CONFIG_PATH=jupyter-config jupyter lab notebooks/01_setup_and_device.ipynb

It adds to your own Jupyter configuration; it replaces nothing in it.
"""
import pathlib

# Serve the whole course, not just the folder of the notebook you open, so that the
# notebooks' ../images/*.svg links resolve.
c.ServerApp.root_dir = str(pathlib.Path(__file__).resolve().parents[1])  # noqa: F821 - c is traitlets' config

# Give the kernel CurveZMQ keys (ipykernel supports them), so its traffic with the server is
# encrypted and it does not warn that it runs "over TCP without encryption".
c.KernelManager.transport_encryption = "auto"  # noqa: F821

# No news feed, no update check: no pop-up asking about either when the course opens.
c.LabApp.news_url = None  # noqa: F821
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"  # noqa: F821
