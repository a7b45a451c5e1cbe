"""nbtool: interactive distributed PyTorch training from Jupyter.

``%load_ext nbtool`` registers the magics. This module stays import-light
because engines import ``nbtool.rank`` (and so this file) too.
"""
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    from .magics import NbtoolMagics

    ipython.register_magics(NbtoolMagics(ipython))
    if getattr(ipython, "kernel", None) is not None:  # in a Jupyter kernel: ask the front end early
        from .widgets import front_end

        front_end.app()


def _magics(ipython=None):
    """The NbtoolMagics instance of this shell (it owns the cluster and the session), or None."""
    if ipython is None:
        from IPython import get_ipython

        ipython = get_ipython()
    if ipython is None:
        return None
    return ipython.magics_manager.registry.get("NbtoolMagics")


def unload_ipython_extension(ipython):
    """Stop the cluster: no engine or controller outlives the extension."""
    magics = _magics(ipython)
    if magics is not None and magics.rank_cluster is not None:
        magics.rank_cluster.stop()
        magics.rank_cluster = None
    from .widgets.figures import _close_retired

    _close_retired(everything=True)


def current_cluster():
    """The running cluster of this kernel (a nbtool.cluster.RankCluster), or None.

    Its ``last_hang`` holds the watchdog's last report (``.summary()``,
    ``.text()``), ``group_closed`` why collectives are unusable, if they are.
    """
    magics = _magics()
    return magics.rank_cluster if magics is not None else None


def predicted_vs_measured(name: str | None = None, calibrate_on: str | None = None):
    """The planner's prediction of the last run (or of the run called ``name``) next to what it
    measured: a nbtool.plan.versus.Versus (``.rows``, ``.text()``; shown as that text), as ``%dist_plan
    --vs NAME`` prints; ``calibrate_on``: the name of the recorded run to calibrate on (``--calibrate-on``)."""
    magics = _magics()
    run = last_run(name)
    if magics is None or run is None:
        return None
    from .actions.plan import calibration_on, versus_for

    return versus_for(magics.session, run, calibration_on(magics.session, magics.recorded_name(calibrate_on))
                       if calibrate_on else None)


def last_run(name: str | None = None):
    """The records of the last ``%%distributed STRATEGY`` run, or of the run called ``name`` (or run
    under that line, as %dist_compare finds it).

    A nbtool.metrics.RunRecords: ``.comms`` (every collective), ``.memory``,
    ``.steps``, ``.scalars``, ``.pipeline``, ``.timelines`` (``--memory-timeline``); None before any
    recorded run, and for a name no run has.
    """
    magics = _magics()
    if magics is None:
        return None
    if name is None:
        return magics.session.last
    from IPython.core.error import UsageError

    from .actions.metrics import stored_runs

    try:
        return stored_runs(magics.session, [magics.recorded_name(name)])[0]
    except UsageError:
        return None
