"""%dist_compare and %dist_metrics: recorded runs, compared and exported."""
from __future__ import annotations

from IPython.core.error import UsageError

from .state import Session


def show_comparison(runs: list, in_kernel: bool, deterministic: bool = False, state: Session | None = None,
                    calibrate_on: str | None = None) -> None:
    """Display the comparison: HTML table + plots in a notebook, text elsewhere; with ``state``, the
    planner's error on each run below it (each predicted from the run before it, or from the
    recorded run ``calibrate_on``).

    ``deterministic`` prints only the columns that do not vary between runs.
    """
    from ..plan.versus import error_table
    from ..widgets import Comparison, show_figure

    calibration = None
    if calibrate_on is not None:
        from .plan import calibration_on, same_device_kind

        calibration = calibration_on(state, calibrate_on)  # checked before anything is shown
        same_device_kind(calibration, [r for r in runs if r.description.param_numels])
    comparison = Comparison(runs)
    results = _planner_results(state, runs, calibration) if state is not None else []
    if deterministic or not in_kernel:
        errors = "\n\n" + error_table(results, deterministic) if results else ""
        print(comparison.text(deterministic=deterministic) + errors)
        return
    from IPython.display import display

    from ..widgets.versus_table import error_table_html

    display(comparison)
    if results:  # a table of its own, like the comparison's: as text its 120-character rows wrapped
        display({"text/plain": error_table(results), "text/html": error_table_html(results)}, raw=True)
    show_figure(comparison.figure())
    if any(r.timelines for r in runs):  # --memory-timeline runs: their timelines, one row per run
        from ..widgets.memory_timeline import timeline_figure

        show_figure(timeline_figure(runs))


def _planner_results(state: Session, runs: list, calibration: tuple | None = None) -> list:
    """The planner's prediction of each run that prepared a model (the run before it calibrating it, or
    ``calibration``)."""
    from .plan import versus_for

    return [versus_for(state, r, calibration) for r in runs if r.description.param_numels]


LISTED_RUNS = 4  # the latest runs an unknown name's error lists (one line, however many runs)


def run_line(run) -> str:
    """The ``%%distributed`` line (after the magic's name) that ``run`` ran under, as nbtool.spec.line_of
    writes it."""
    from ..plan.versus import spec_of
    from ..spec import line_of

    return line_of(spec_of(run))


def stored_runs(state: Session, names: list[str]) -> list:
    """The recorded runs called ``names`` (all of them where none is given); a name no run has may be
    the line one ran under (``"tp --sp"``, for the run named ``tp``)."""
    if not state.runs:
        raise UsageError("no recorded runs yet; run a %%distributed STRATEGY cell first")
    found = []
    for name in names:
        if name in state.runs:
            found.append(state.runs[name])
            continue
        by_line = [r for r in state.runs.values() if run_line(r) == " ".join(name.split())]
        if len(by_line) != 1:
            listed = [repr(n) + (f" ({line})" if (line := run_line(r)) != n else "") for n, r in state.runs.items()]
            more = len(listed) - LISTED_RUNS
            raise UsageError(f"no run named {name!r}; recorded runs: {', '.join(listed[-LISTED_RUNS:])}"
                             + (f" and {more} before them (%dist_compare lists every run)" if more > 0 else ""))
        found.append(by_line[0])
    return found if names else list(state.runs.values())


def export_run(state: Session, path: str, name: str | None) -> str:
    from .. import metrics

    run = stored_runs(state, [name])[0] if name else state.last
    if run is None:
        raise UsageError("no recorded run yet; run a %%distributed STRATEGY cell first")
    if not str(path).endswith((".json", ".csv")):
        raise UsageError(f"export path {path!r}: use a .json or .csv file name")
    try:
        metrics.export(run, path)
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror}") from None
    return f"wrote {len(run.comms)} collectives, {len(run.memory)} memory samples, {len(run.steps)} steps of run {run.name!r} to {path}"


def load_run(state: Session, path: str, name: str | None) -> str:
    """``%dist_metrics load``: an exported run (JSON: its records and description) recorded in this
    kernel under its own name or ``name``; a name already recorded is refused, so nothing is lost."""
    import os

    from .. import metrics

    if not str(path).endswith(".json"):
        raise UsageError(f"load path {path!r}: use a .json export (a .csv lacks the run's description, "
                         "which the planner needs; read it with nbtool.metrics.load)")
    if not os.path.isfile(path):
        raise UsageError(f"load path {path!r}: no such file")
    try:
        run = metrics.load(path)
    except (ValueError, KeyError, TypeError) as e:  # another schema, or not a run export
        raise UsageError(f"cannot load {path!r}: {e}") from None
    except OSError as e:
        raise UsageError(f"cannot read {path!r}: {e.strerror}") from None
    run.name = name or run.name
    if run.name in state.runs:
        raise UsageError(f"a run named {run.name!r} is recorded already; load it under another: --name NEW")
    state.runs[run.name] = run
    steps = sum(1 for m in run.steps if m.rank == 0)
    return f"recorded run {run.name!r} from {path}: {run.strategy}, {run.world_size} ranks, {steps} steps"
