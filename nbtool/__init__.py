"""nbtool: interactive distributed PyTorch training from Jupyter.

``%load_ext nbtool`` registers the magics. This module stays import-light
because engines import ``nbtool.rank`` (and so this file) too.
"""
__version__ = "0.1.0"

_magics = None


def load_ipython_extension(ipython):
    global _magics
    from .magics import NbtoolMagics

    _magics = NbtoolMagics(ipython)
    ipython.register_magics(_magics)
    if getattr(ipython, "kernel", None) is not None:  # in a Jupyter kernel: ask the front end early
        from .widgets import front_end

        front_end.app()


def unload_ipython_extension(ipython):
    """Stop the cluster: no engine or controller outlives the extension."""
    global _magics
    if _magics is not None and _magics.rank_cluster is not None:
        _magics.rank_cluster.stop()
        _magics.rank_cluster = None
    _magics = None
    from .widgets.figures import _close_retired

    _close_retired(everything=True)


def current_cluster():
    """The running cluster of this kernel (a nbtool.cluster.RankCluster), or None.

    Its ``last_hang`` holds the watchdog's last report (``.summary()``,
    ``.text()``), ``group_closed`` why collectives are unusable, if they are.
    """
    return _magics.rank_cluster if _magics is not None else None


def last_run(name: str | None = None):
    """The records of the last ``%%distributed STRATEGY`` run, or of the run called ``name``.

    A nbtool.metrics.RunRecords: ``.comms`` (every collective), ``.memory``,
    ``.steps``, ``.scalars``, ``.pipeline``; None before any recorded run.
    """
    from . import session

    if name is not None:
        return session.RUNS.get(name)
    return session.LAST[0] if session.LAST else None
