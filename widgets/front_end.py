"""What the notebook's front end can do, learnt from the front end itself (kernel side).

ipylab's ``JupyterFrontEnd`` is a widget model without a view: in JupyterLab
and Notebook 7 its front-end half answers with the list of commands the page
runs, which gives nbtool two things a kernel cannot get alone:

- a way to act on the notebook from a widget callback (the picker's Apply runs
  ``notebook:insert-cell-below``);
- knowing that a JupyterLab-family page is rendering the outputs (headless
  runs such as nbconvert or nbval have no widget front end, so the list stays
  empty): then plotly's own renderer draws static figures and stores a PNG of
  each in the notebook by itself (see nbtool.widgets.figures).

Created once per kernel, at ``%load_ext nbtool``, so the answer has arrived by
the time the first figure is shown.
"""
from __future__ import annotations

_app: list = []  # [JupyterFrontEnd] once created; [None] where ipylab is missing


def app():
    """The kernel's ipylab handle (created on first use), or None without ipylab."""
    if not _app:
        try:
            from ipylab import JupyterFrontEnd
        except ImportError:
            _app.append(None)
        else:
            _app.append(JupyterFrontEnd())
    return _app[0]


def has_command(name: str) -> bool:
    """True when a connected JupyterLab-family page runs command ``name``."""
    a = app()
    if a is None:
        return False
    try:
        return name in a.commands.list_commands()
    except Exception:  # not connected (no front end answered)
        return False


def renders_plotly() -> bool:
    """A JupyterLab / Notebook 7 page is showing this kernel's outputs (it makes figure PNGs itself)."""
    return has_command("notebook:insert-cell-below")
