"""What each magic does once its line is parsed: the kernel-side actions.

Magics call exactly one function here; these wire the cluster and execution
layers to the notebook's display.
"""
from __future__ import annotations

import sys
import time

import ipyparallel as ipp
from IPython.core.error import UsageError

from . import protocol
from .cluster import RankCluster
from .execution import run_cell
from .options import ClusterOptions, format_ranks, label_ranks


def start(opts: ClusterOptions, in_kernel: bool) -> RankCluster:
    return RankCluster.start(opts, progress=_progress(in_kernel))


def stop(cluster: RankCluster) -> None:
    cluster.stop()


def status(cluster: RankCluster):
    from .widgets import StatusTable

    layout = cluster.layout
    header = (
        f"{layout.n} rank(s), backend {layout.backend}, "
        f"{'GPUs ' + ','.join(map(str, layout.gpus)) if layout.gpus else 'CPU'}; "
        f"collective timeout {cluster.collective_timeout:g}s; "
        "rss = resident set size of the engine process (OS figure)"
    )
    rows = cluster.status()
    lost = cluster.lost_ranks()
    if lost or cluster.group_closed:
        header += (f"\nprocess group unusable ({cluster.group_closed or 'engines lost'}"
                   f"{'; lost: ' + label_ranks(lost) if lost else ''}): "
                   f"%cluster restart brings back {layout.n} fresh rank(s)")
    return StatusTable(rows, header=header)


def restart(cluster: RankCluster, in_kernel: bool) -> None:
    cluster.restart(_progress(in_kernel))


def _progress(in_kernel: bool):
    from .widgets import ProgressLine

    return ProgressLine(in_kernel)


def _prepare_cell(cluster: RankCluster, ranks: list[int], collective_timeout: float | None,
                  collectives: bool) -> None:
    """Checks before a cell runs: ranks alive, process group usable, watchdog timeout set."""
    _check_alive(cluster, ranks)
    if cluster.group_closed:
        msg = (f"the process group is unusable ({cluster.group_closed}); "
               f"%cluster restart brings back {cluster.world_size} fresh rank(s)")
        if collectives:
            raise UsageError(msg)
        print(f"nbtool: {msg}; this cell runs, but any collective in it will fail", file=sys.stderr)
    cluster.set_collective_timeout(collective_timeout or cluster.options.collective_timeout)


def run(cluster: RankCluster, code: str, ranks: list[int], *, in_kernel: bool,
        timeout: float | None, quiet: bool, collective_timeout: float | None = None) -> None:
    _prepare_cell(cluster, ranks, collective_timeout, collectives=False)
    run_cell(cluster, code, ranks, in_kernel=in_kernel, timeout=timeout, quiet=quiet,
             progress=_progress(in_kernel))


# runs recorded in this kernel, by name (latest first wins a name); LAST is the newest
RUNS: dict = {}
LAST: list = []  # [RunRecords] (a list so callers can read it after reassignment)

FINISH_TIMEOUT_S = 30.0
COMMBENCH: list = []  # [the last CommbenchResult], used by the planner


def run_strategy(cluster: RankCluster, code: str, spec, *, in_kernel: bool, timeout: float | None,
                 quiet: bool, export_config: str | None = None, metrics: bool = True, watch: bool = True,
                 name: str | None = None, collective_timeout: float | None = None):
    """Install ``strategy`` on every rank, run the cell (recording it), then report.

    Returns the run's RunRecords (None with metrics off). The live dashboard
    shows only in a Jupyter kernel; a static copy of its final figures stays
    in the output.
    """
    from .metrics import RunRecords
    from .rank import strategies
    from .spec import deepspeed_config, dumps_config

    ranks = list(range(cluster.world_size))
    _prepare_cell(cluster, ranks, collective_timeout, collectives=True)
    if export_config:
        text = dumps_config(deepspeed_config(spec, cluster.world_size))
        try:
            with open(export_config, "w") as f:
                f.write(text)
        except OSError as e:
            raise UsageError(f"--export-config {export_config!r}: {e.strerror}") from None
    run = RunRecords(name=name or spec.name, strategy=spec.name, world_size=cluster.world_size, t_start=time.time())
    dash = None
    if metrics and watch and in_kernel and not quiet:
        from .widgets import Dashboard

        from .spec import LAYOUT_NAMES, ParallelDims

        pipeline = spec.name in LAYOUT_NAMES and ParallelDims.resolve(spec, cluster.world_size).pp > 1
        from .widgets.figures import show_live

        dash = Dashboard(cluster.world_size, title=f"{run.name}: live", pipeline=pipeline)
        dash_id = show_live(dash.widget)
    try:
        cluster.view(ranks).apply_sync(strategies.install, spec, metrics, dash is not None)
    except BaseException:
        _finish(cluster, ranks, want_summary=False)  # ranks where it worked: stop their recorders
        if dash is not None:
            from .widgets.figures import replace_live

            replace_live(dash_id, retire=dash)
        raise
    live = _LiveRecords(run, dash)
    finished = None
    ok = False
    try:
        run_cell(cluster, code, ranks, in_kernel=in_kernel, timeout=timeout, quiet=quiet,
                 on_tick=live if dash is not None else None, progress=_progress(in_kernel))
        ok = True
    finally:
        # always stop the recorders: their sampling thread runs and the watchdog's wrappers report to them
        finished = _finish(cluster, ranks, want_summary=not quiet)
        if metrics and finished is not None:
            run = RunRecords(name=run.name, strategy=run.strategy, world_size=run.world_size, t_start=run.t_start,
                             t_end=time.time(), description=finished[0]["description"])
            for part in finished:
                run.add(part["records"])
            if ok:  # a failed run is kept for inspection (last_run()), never as a comparison row
                RUNS[run.name] = run
            LAST[:] = [run]
        if dash is not None:  # the live widget's output becomes its static copy, in place
            from .widgets.figures import replace_live

            dash.refresh(run, force=True)
            replace_live(dash_id, dash.static(run), retire=dash)
    if not quiet and finished is not None and finished[0]["summary"]:
        print(finished[0]["summary"])
        if export_config:
            print(f"DeepSpeed config written to {export_config}")
    return run if metrics else None


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


def _finish(cluster: RankCluster, ranks: list[int], want_summary: bool):
    from .rank import strategies

    if cluster.lost_ranks() or cluster.client is None:
        return None  # the cell's error already says which ranks are gone
    try:
        return cluster.view(ranks).apply_async(strategies.finish, want_summary).get(timeout=FINISH_TIMEOUT_S)
    except Exception as e:  # a rank still stuck (after a timeout/interrupt) or gone
        print(f"nbtool: could not collect the run's records from every rank ({type(e).__name__}); "
              "%cluster restart if ranks are stuck", file=sys.stderr)
        return None


def compare(cluster: RankCluster, code: str, runs: list[tuple[str, object]], *, in_kernel: bool,
            timeout: float | None, quiet: bool, collective_timeout: float | None = None):
    """Run the cell once per (name, spec) on the same cluster, then show the comparison."""
    recorded = []
    for name, spec in runs:
        if not quiet:
            print(f"--- {name} ---")
        recorded.append(run_strategy(cluster, code, spec, in_kernel=in_kernel, timeout=timeout, quiet=quiet,
                                     name=name, collective_timeout=collective_timeout))
    show_comparison(recorded, in_kernel)


def show_comparison(runs: list, in_kernel: bool, deterministic: bool = False) -> None:
    """Display the comparison: HTML table + plots in a notebook, text elsewhere.

    ``deterministic`` prints only the columns that do not vary between runs.
    """
    from .widgets import Comparison, show_figure

    comparison = Comparison(runs)
    if deterministic or not in_kernel:
        print(comparison.text(deterministic=deterministic))
        return
    from IPython.display import display

    display(comparison)
    show_figure(comparison.figure())


def stored_runs(names: list[str]) -> list:
    if not RUNS:
        raise UsageError("no recorded runs yet; run a %%distributed STRATEGY cell first")
    missing = [n for n in names if n not in RUNS]
    if missing:
        raise UsageError(f"no run named {missing[0]!r}; recorded runs: {', '.join(map(repr, RUNS))}")
    return [RUNS[n] for n in names] if names else list(RUNS.values())


def export_run(path: str, name: str | None) -> str:
    from . import metrics

    run = stored_runs([name])[0] if name else (LAST[0] if LAST else None)
    if run is None:
        raise UsageError("no recorded run yet; run a %%distributed STRATEGY cell first")
    if not str(path).endswith((".json", ".csv")):
        raise UsageError(f"export path {path!r}: use a .json or .csv file name")
    try:
        metrics.export(run, path)
    except OSError as e:
        raise UsageError(f"cannot write {path!r}: {e.strerror}") from None
    return f"wrote {len(run.comms)} collectives, {len(run.memory)} memory samples, {len(run.steps)} steps of run {run.name!r} to {path}"


def commbench(cluster: RankCluster, ops: list[str], sizes: list[int], dtype: str, iters: int, warmup: int,
              ranks: list[int], inplace: bool, in_kernel: bool, label: str = ""):
    """Run a %commbench sweep on the cluster; returns a CommbenchResult (plots live in a notebook)."""
    from .commbench import DTYPES, CommbenchResult, element_count
    from .rank import commbench as rank_bench

    everyone = list(range(cluster.world_size))
    _prepare_cell(cluster, everyone, None, collectives=True)
    n = len(ranks)
    counts = {op: sorted({element_count(op, s, n, DTYPES[dtype]) for s in sizes}) for op in ops}
    plot = plot_id = None
    if in_kernel:
        from .widgets.commbench_view import SweepPlot
        from .widgets.figures import show_live

        plot = SweepPlot(ops)
        plot_id = show_live(plot.fig)
    # every rank takes part: creating the sub-group (if any) is collective over the world
    ar = cluster.view(everyone).apply_async(rank_bench.run_sweep, ops, counts, dtype, iters, warmup,
                                            tuple(ranks), inplace, plot is not None)
    seen: dict = {}
    try:
        while not ar.wait(0.1):
            if plot is None:
                continue
            for f in ar._children:
                for key, row in protocol.entries(f, "commbench"):
                    seen.setdefault(key, row)
            if seen:
                plot.show_rows(list(seen.values()), n)
        per_rank = ar.get()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            cluster.signal(everyone, "SIGINT")
            ar.wait(5)
        if plot is not None:
            from .widgets.figures import replace_live

            replace_live(plot_id, retire=plot)
        raise
    result = CommbenchResult.from_rank_rows(per_rank, backend=cluster.layout.backend, ranks=list(ranks),
                                            dtype=dtype, iters=iters, warmup=warmup, inplace=inplace, label=label)
    if plot is not None:  # the live plot's output becomes the result's static figure, in place
        from .widgets.figures import replace_live

        replace_live(plot_id, result.figure(), retire=plot)
    COMMBENCH[:] = [result]
    if result.wrong:
        print(f"commbench: {result.wrong} result element(s) were WRONG: the collective is broken "
              "for the sizes marked in the #wrong column", file=sys.stderr)
    return result


def plan(args, cluster, in_kernel: bool, shell):
    """%dist_plan: the picker widget, or the ranked recommendation as text."""
    from .plan.inputs import HARDWARE_PRESETS, MODEL_PRESETS, ModelShape, Training
    from .plan.recommend import recommend, runnable_choices

    hw = None
    if args.hardware is not None:
        hw = HARDWARE_PRESETS[_preset(args.hardware, HARDWARE_PRESETS, "--hardware")]
    elif cluster is not None and cluster.running:
        from .plan.detect import hardware_from_facts
        from .rank.bootstrap import hardware_facts

        facts = cluster.view([0]).apply_sync(hardware_facts)[0]
        hw = hardware_from_facts(facts, cluster.world_size, cluster.layout.backend)
        if COMMBENCH and "all_reduce" in COMMBENCH[0].fits:
            hw = hw.with_commbench(COMMBENCH[0])
    model_name, shape = "GPT-2 small (124M)", None
    if args.model is not None:
        if not args.model.replace(".", "").replace("e", "").replace("E", "").isdigit():
            model_name = _preset(args.model, MODEL_PRESETS, "--model")
        else:
            try:
                shape = ModelShape(int(float(args.model)), name=f"{float(args.model):.3g} params")
            except ValueError:
                raise UsageError(f"--model {args.model!r}: give a preset ({', '.join(MODEL_PRESETS)}) "
                                 "or a parameter count like 7e9") from None
            if shape.params < 1:
                raise UsageError(f"--model {args.model!r}: the parameter count must be >= 1")
    if in_kernel and not args.text:
        from IPython.display import display

        from .widgets.picker import Picker

        picker = Picker(hardware=hw, model=model_name if shape is None else "custom", shell=shell)
        with picker.quiet():  # one chart update after all inputs are set
            if shape is not None:
                picker.custom_params.value = shape.params / 1e9
            if args.devices:
                picker.devices.value = args.devices
            picker.micro_batch.value = args.micro_batch
            picker.seq.value = args.seq or 0
            picker.precision.value = args.precision
            picker.checkpointing.value = args.checkpointing
        picker.update()
        picker.show()
        return None
    hw = hw or HARDWARE_PRESETS["8x A100-80GB NVLink"]
    if args.devices:
        hw = hw.with_devices(args.devices)
    shape = shape or MODEL_PRESETS[model_name]
    training = Training(micro_batch=args.micro_batch, seq=args.seq, precision=args.precision,
                        checkpointing=args.checkpointing)
    rec = recommend(shape, training, hw)
    print(f"{shape.name or shape.params}: {shape.params / 1e9:.2f}B parameters on {hw.devices} x "
          f"{hw.device_memory / 2**30:.0f} GiB ({hw.name}{', measured links' if hw.measured else ''}); "
          f"{training.precision}, micro-batch {training.micro_batch}, checkpointing {training.checkpointing}")
    for i, line in enumerate(rec.lines(), 1):
        print(f"{i:>2}. {line}")
    choices = runnable_choices(rec, training)
    if choices:
        print(f"run it: %%distributed {choices[0].magic_line(training)}")
    return None


def _preset(text: str, table: dict, option: str) -> str:
    """A preset by a forgiving name: case, spaces and punctuation ignored; a unique fragment is enough."""
    norm = lambda x: "".join(ch for ch in x.lower() if ch.isalnum())
    key = norm(text)
    exact = [name for name in table if norm(name) == key]
    hits = exact or [name for name in table if key and key in norm(name)]
    if len(hits) != 1:
        what = "matches several presets" if hits else "is not a preset"
        raise UsageError(f"{option} {text!r} {what}; presets: {', '.join(table)}")
    return hits[0]


def plan_vs_last() -> None:
    """Predicted (nbtool.plan) vs measured (memory ledger) model states for the last recorded run."""
    from .plan.estimate import estimate
    from .plan.inputs import Hardware, ModelShape, Training
    from .run_analysis import peak_ledger

    if not LAST:
        raise UsageError("no recorded run yet; run a %%distributed STRATEGY cell first")
    run = LAST[0]
    desc = run.description
    if not desc.param_numels:
        raise UsageError(f"run {run.name!r} has no model description (did the cell call strategy.prepare?)")
    numels = desc.param_numels
    shape = ModelShape(sum(numels), numels=tuple(numels))
    layout = {"fsdp": "fsdp" if desc.reshard_after_forward else "fsdp-grad-op"}.get(run.strategy, run.strategy)
    hw = Hardware("this run", 1, run.world_size, 1e15, 1e15, 1e9, 1e9)
    precision = desc.precision
    dims = desc.dims  # (dp, tp, pp) for mesh layouts only
    note = None
    if dims is None:
        tp = pp = 1
    else:
        dp, tp, pp = dims
        layout = "tp-pp" if tp > 1 and pp > 1 else ("tp" if tp > 1 else "pp")
        note = ("the planner splits every parameter over tp x pp (Megatron's approximation); here embeddings, "
                "norms and row-parallel biases stay whole under tp, and stages differ in size under pp"
                + ("; FSDP over dp shards further (not predicted)" if run.strategy == "fsdp" and dp > 1 else ""))
    e = estimate(layout, shape, Training(precision=precision), hw, tp=tp, pp=pp)
    print(f"run {run.name!r} ({run.strategy}, {precision}, {run.world_size} ranks): model states in bytes")
    print(f"{'category':<12} {'predicted':>14} " + " ".join(f"{'rank ' + str(r):>14}" for r in range(run.world_size)))
    measured = [peak_ledger(run, r) for r in range(run.world_size)]
    rows = [("params", ["params"]), ("grads", ["grads"]), ("optimizer", ["master_params", "optimizer_state", "other"])]
    for name, cats in rows:
        vals = [sum(m[c] for c in cats) for m in measured]
        print(f"{name:<12} {int(e.device.get(name, 0)):>14,} " + " ".join(f"{v:>14,}" for v in vals))
    if note:
        print(f"note: {note}")


def checkpoint(cluster: RankCluster, action: str, path: str, optimizer: bool = True) -> dict:
    """%dist_checkpoint: save or load on every rank through the last strategy cell's strategy."""
    from .execution import RankError
    from .faults import RankFailure
    from .rank import strategies

    ranks = list(range(cluster.world_size))
    _prepare_cell(cluster, ranks, None, collectives=True)
    ar = cluster.view(ranks).apply_async(strategies.checkpoint, action, path, optimizer)
    try:
        while not ar.wait(0.1):
            pass
    except KeyboardInterrupt:
        cluster.signal(ranks, "SIGINT")
        ar.wait(5)
        raise
    try:
        results = ar.get()
    except ipp.error.CompositeError as e:
        if all(ename == "StrategyError" for ename, *_ in e.elist):  # nothing prepared: a usage mistake
            raise UsageError(f"%dist_checkpoint {action}: {e.elist[0][1]}") from None
        groups: dict = {}
        for ename, evalue, tb, info in e.elist:
            groups.setdefault((ename, evalue), ([], RankFailure(ename, evalue)))[0].append(
                cluster.rank_of(info["engine_id"]))
        raise RankError(sorted(groups.values(), key=lambda g: g[0][0])) from None
    info = results[0]
    if action == "save":
        print(f"saved step {info['steps']} to {info['path']}/{info['dir']} "
              f"({info['bytes'] / 2**20:.1f} MiB, {info['seconds']:.2f} s)")
    else:
        print(f"loaded step {info['steps']} from {info['path']}/{info['dir']} "
              f"(saved by {info['saved_by']}): {info['restored']}")
    return info


def push(cluster: RankCluster, values: dict, ranks: list[int]) -> None:
    _check_alive(cluster, ranks)
    cluster.view(ranks).push(values, block=True)


def pull(cluster: RankCluster, names: list[str], rank: int | None) -> dict:
    ranks = [rank] if rank is not None else list(range(cluster.world_size))
    _check_alive(cluster, ranks)
    out = {}
    for name in names:
        try:
            values = cluster.view(ranks).pull(name, block=True)
        except ipp.error.CompositeError as e:
            bad = sorted(cluster.rank_of(err[3]["engine_id"]) for err in e.elist if err[3])
            raise UsageError(
                f"{name!r} is not defined on rank(s) {format_ranks(bad) or '?'}; "
                "assign it in a %%distributed cell first"
            ) from None
        except ipp.error.RemoteError:
            raise UsageError(f"{name!r} is not defined on rank {rank}; assign it in a %%distributed cell first") from None
        out[name] = values[0] if rank is not None else list(values)
    return out


def _check_alive(cluster: RankCluster, ranks: list[int]) -> None:
    lost = sorted(set(ranks) & set(cluster.lost_ranks()))
    if lost:
        reasons = "; ".join(f"rank {r}: {cluster.exit_reason(r)}" for r in lost)
        raise UsageError(
            f"rank(s) {format_ranks(lost)} are no longer connected ({reasons}); "
            f"%cluster restart brings back {cluster.world_size} fresh rank(s)"
        )
