"""%%distributed and %%rank: run a cell on the ranks, plain or under a strategy (and compare strategies)."""
from __future__ import annotations

import sys
import time

from IPython.core.error import UsageError

from .. import protocol
from ..cluster import RankCluster
from ..execution import run_cell
from .common import prepare_cell, progress_line
from .metrics import run_line, show_comparison
from .state import Session

FINISH_TIMEOUT_S = 30.0
TIMELINE_FINISH_S = 600.0  # --memory-timeline: torch works out the categories after the cell, about as long as it ran


def run(cluster: RankCluster, code: str, ranks: list[int], *, in_kernel: bool,
        timeout: float | None, quiet: bool, collective_timeout: float | None = None) -> None:
    prepare_cell(cluster, ranks, collective_timeout, collectives=False)
    run_cell(cluster, code, ranks, in_kernel=in_kernel, timeout=timeout, quiet=quiet, progress=progress_line(in_kernel))


def run_strategy(state: Session, cluster: RankCluster, code: str, spec, *, in_kernel: bool, timeout: float | None,
                 quiet: bool, export_config: str | None = None, metrics: bool = True, watch: bool = True,
                 name: str | None = None, collective_timeout: float | None = None):
    """Install ``strategy`` on every rank, run the cell (recording it), then report.

    Returns the run's RunRecords (None with metrics off). The live dashboard
    shows only in a Jupyter kernel; a static copy of its final figures stays
    in the output.
    """
    from ..metrics import RunRecords
    from ..rank import strategies
    from ..spec import LAYOUT_NAMES, ParallelDims, deepspeed_config, dumps_config

    ranks = list(range(cluster.world_size))
    if spec.checkpoint_every and cluster.options.multi_host:  # before the cell: every rank saves there
        cluster.check_shared(spec.checkpoint_dir or "checkpoints", "--checkpoint-dir")
    prepare_cell(cluster, ranks, collective_timeout, collectives=True)
    if export_config:
        text = dumps_config(deepspeed_config(spec, cluster.world_size))
        try:
            with open(export_config, "w") as f:
                f.write(text)
        except OSError as e:
            raise UsageError(f"--export-config {export_config!r}: {e.strerror}") from None
    run = RunRecords(name=name or run_name(state, spec), strategy=spec.name, world_size=cluster.world_size,
                     t_start=time.time())
    dash = None
    if metrics and watch and in_kernel and not quiet:
        from ..widgets import Dashboard
        from ..widgets.figures import replace_live, show_live

        pipeline = spec.name in LAYOUT_NAMES and ParallelDims.resolve(spec, cluster.world_size).pp > 1
        dash = Dashboard(cluster.world_size, title=f"{run.name}: live", pipeline=pipeline,
                         cuda=cluster.layout.device_kind == "cuda")
        dash_id = show_live(dash.widget)
    try:
        cluster.view(ranks).apply_sync(strategies.install, spec, metrics, dash is not None)
    except BaseException:
        _finish(cluster, ranks, want_summary=False)  # ranks where it worked: stop their recorders
        if dash is not None:
            replace_live(dash_id, retire=dash)
        raise
    ok = False
    try:
        run_cell(cluster, code, ranks, in_kernel=in_kernel, timeout=timeout, quiet=quiet,
                 on_tick=_LiveRecords(run, dash) if dash is not None else None, progress=progress_line(in_kernel))
        ok = True
    finally:
        # always stop the recorders: their sampling thread runs and the watchdog's wrappers report to them
        if spec.memory_timeline is not None and not quiet:
            print("nbtool: working out the memory timeline's categories on every rank ...", file=sys.stderr)
        finished = _finish(cluster, ranks, want_summary=not quiet,
                           timeout=FINISH_TIMEOUT_S + TIMELINE_FINISH_S * (spec.memory_timeline is not None))
        if metrics and finished is not None:
            run = RunRecords(name=run.name, strategy=run.strategy, world_size=run.world_size, t_start=run.t_start,
                             t_end=time.time(), description=finished[0]["description"])
            for part in finished:
                run.add(part["records"])
            kept = state.runs.get(run.name)
            if ok and (run.description.param_numels or kept is None or not kept.description.param_numels):
                if kept is not None and name is None and (line := run_line(kept)) != run_line(run):
                    _rename(state, kept, line)  # a plain strategy word after a line of options
                state.runs[run.name] = run  # a failed run is kept for inspection (last_run()), never as a row
            elif ok:  # a cell that never called strategy.prepare does not replace a run that did
                print(f"nbtool: the run {run.name!r} recorded before is kept for %dist_compare and %dist_plan: "
                      "this cell never called strategy.prepare (nbtool.last_run() has it)", file=sys.stderr)
            state.last = run
        if dash is not None:  # the live widget's output becomes its static copy, in place
            dash.refresh(run, force=True)
            replace_live(dash_id, dash.static(run), retire=dash)
    if not quiet and finished is not None and finished[0]["summary"]:
        print(finished[0]["summary"])
        if export_config:
            print(f"DeepSpeed config written to {export_config}")
    if metrics and run.timelines and not quiet:
        _show_timelines(run, in_kernel)
    if metrics:
        from .plan import after_run

        after_run(state, run, show=watch and not quiet, in_kernel=in_kernel)
    return run if metrics else None


def _rename(state: Session, run, name: str) -> None:
    """Keep ``run`` under ``name`` (its line) where a plain strategy word's run takes over its name; what
    the session keeps of it (its prediction, its calibration, the advice it was given) follows."""
    from dataclasses import replace

    from ..plan.versus import quoted

    old = run.name
    print(f"nbtool: this run takes the name {old!r}; the run of `{name}` before it is kept as {quoted(name)}",
          file=sys.stderr)
    run.name = name
    state.runs[name] = state.runs.pop(old)
    if (v := state.versus.get(old)) is not None and v.run is run:
        state.versus[name] = replace(state.versus.pop(old), run_name=name)
    if state.calibration is not None and state.calibration[2] is run:
        state.calibration = (state.calibration[0], name, run)
    state.advice = [replace(s, base_run=name) if s.base_run == old else s for s in state.advice]


def run_name(state: Session, spec) -> str:
    """A run's default name: the strategy word, which a cell run again with the same line takes over.
    Named by its line instead where a run of another line holds the word (``fsdp``, then ``fsdp
    --precision bf16``: both stay recorded, for %dist_compare side by side), and where it is a line
    nbtool suggested, run as written (the run it was suggested from stays beside it)."""
    from ..spec import line_of
    from .metrics import run_line

    line = line_of(spec)
    held = state.runs.get(spec.name)
    if any(s.line == line and s.base_run == spec.name for s in state.advice) or (
            held is not None and run_line(held) != line):
        return line
    return spec.name


def _show_timelines(run, in_kernel: bool) -> None:
    from .. import run_analysis

    print("memory timeline (tracked tensor bytes by category, torch.profiler's memory profile):")
    print("\n".join("  " + line for line in run_analysis.timeline_lines(run)))
    if in_kernel:
        from ..widgets import show_figure
        from ..widgets.memory_timeline import timeline_figure

        show_figure(timeline_figure([run]))


class _LiveRecords:
    """Feeds records published by the ranks during the cell to the dashboard (kernel thread)."""

    def __init__(self, run, dash):
        self.run, self.dash, self.seen = run, dash, set()

    def __call__(self, children) -> None:
        fresh = False
        for _, f in children:
            for key, records in protocol.entries(f, "records"):
                if key not in self.seen:
                    self.seen.add(key)
                    self.run.add(records)
                    fresh = True
        if fresh:
            self.dash.refresh(self.run)


def _finish(cluster: RankCluster, ranks: list[int], want_summary: bool, timeout: float = FINISH_TIMEOUT_S):
    from ..rank import strategies

    if cluster.lost_ranks() or cluster.client is None:
        return None  # the cell's error already says which ranks are gone
    try:
        return cluster.view(ranks).apply_async(strategies.finish, want_summary).get(timeout=timeout)
    except Exception as e:  # a rank still stuck (after a timeout/interrupt) or gone
        said = str(e).strip().splitlines()  # a CompositeError's last line names the rank and what happened
        print(f"nbtool: could not collect the run's records from every rank ({type(e).__name__}"
              f"{': ' + said[-1][:200] if said else ''}); %cluster restart if ranks are stuck", file=sys.stderr)
        return None


def compare(state: Session, cluster: RankCluster, code: str, runs: list[tuple[str, object]], *, in_kernel: bool,
            timeout: float | None, quiet: bool, collective_timeout: float | None = None):
    """Run the cell once per (name, spec) on the same cluster, then show the comparison."""
    recorded = []
    for name, spec in runs:
        if not quiet:
            print(f"--- {name} ---")
        recorded.append(run_strategy(state, cluster, code, spec, in_kernel=in_kernel, timeout=timeout, quiet=quiet,
                                     name=name, collective_timeout=collective_timeout))
    show_comparison(recorded, in_kernel, state=state)
