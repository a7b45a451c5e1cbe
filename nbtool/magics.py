"""IPython magics: parse the line, check it, call one function below.

Every user mistake becomes a short UsageError naming the bad value and what
is allowed. A line is checked in full before anything runs; the only work
done first is asking a running cluster for facts a check needs (%dist_plan
reads the ranks' hardware to resolve its defaults).
"""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, argument_group, magic_arguments
from IPython.core.magic_arguments import parse_argstring as _parse_argstring

from .options import (BACKENDS, LAUNCHERS, ClusterOptions, check_launch, format_ranks, parse_hosts, parse_int_list,
                      parse_rendezvous, parse_ranks, positive_int, positive_number, positive_seconds, rank_number,
                      strategy_options_given, strategy_spec, unchecked_spec)
from .spec import ABSENT, OPTION_FIELDS, PRECISIONS, flag_name
from .spec import GROUPS as OPTION_GROUPS
from .spec import NAMES as STRATEGIES

NO_CLUSTER = "no cluster is running; start one with %cluster start -n 2"


def parse_argstring(magic, line: str):
    """IPython's parser, with shell-quoting mistakes (an unclosed quote) as UsageErrors too."""
    try:
        args = _parse_argstring(magic, line)
    except ValueError as e:  # shlex: "No closing quotation", "No escaped character"
        raise UsageError(f"cannot split {line!r}: {e}; close the quote or escape it") from None
    _refuse_repeats(magic.parser, line)
    return args


def _refuse_repeats(parser, line: str) -> None:
    """argparse keeps the last of an option given twice (``--vs a --vs b``, ``--bf16 --no-bf16``): the
    user meant one of them, and nbtool would silently pick; refuse instead."""
    from IPython.utils.process import arg_split

    options = parser._option_string_actions  # exact strings; argparse also takes unique prefixes
    seen: dict[str, str] = {}
    for token in arg_split(line):
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        opt = token.split("=", 1)[0]
        matches = [o for o in options if o == opt] or [o for o in options if o.startswith(opt)]
        if len(matches) != 1 or options[matches[0]].dest == "help":
            continue
        dest = options[matches[0]].dest
        if dest in seen:
            first = seen[dest]
            raise UsageError(f"{first} is given twice: give it once" if first == matches[0] else
                             f"{first} and {matches[0]} set the same option: give one")
        seen[dest] = matches[0]


def _unquoted(text: str) -> str:
    """A quoted option value as written inside the quotes (IPython's line splitting keeps them)."""
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text


def _cell_options(f):
    """Options shared by %%distributed and %%rank."""
    for a in reversed((
        argument_group("cell options"),
        argument("--timeout", type=positive_seconds, default=None,
                 help="stop the cell after SECONDS, naming the ranks that had not finished"),
        argument("--quiet", action="store_true",
                 help="show nothing but errors (no rank output, no nbtool messages)"),
        argument("--collective-timeout", type=positive_seconds, default=None, metavar="SECONDS",
                 help="the hang watchdog reports a collective still running after SECONDS "
                      "(default: the cluster's, 60)"),
    )):
        f = a(f)
    return f


ARG_TYPES = {"positive_int": positive_int, "positive_number": positive_number, "int": int}


def _option_arguments(fld) -> list:
    """The argparse arguments of one StrategySpec option field (see nbtool.spec.option)."""
    meta = fld.metadata
    name, kind = flag_name(fld), meta["kind"]
    absent = ABSENT[kind]
    extra = dict(meta["argparse"])
    if kind == "switch":
        return [argument(name, dest=fld.name, action="store_true", default=absent, help=meta["help"])]
    if kind == "off":
        return [argument(name, dest=fld.name, action="store_true", default=absent, help="(the default)"),
                argument("--no-" + name[2:], dest=fld.name, action="store_false", help=meta["help"])]
    if kind == "both":
        return [argument(name, dest=fld.name, action="store_true", default=absent, help=meta["help"]),
                argument("--no-" + name[2:], dest=fld.name, action="store_false", default=absent)]
    if "type" in extra:
        extra["type"] = ARG_TYPES.get(extra["type"], str)
    return [argument(name, dest=fld.name, default=absent, help=meta["help"], **extra)]


# options of a strategy line that are not part of the spec: how nbtool runs and records the cell
RUN_OPTIONS = (
    argument("--export-config", default=None, metavar="FILE",
             help="zero*: write the exact DeepSpeed JSON used to FILE"),
    argument("--no-metrics", dest="metrics", action="store_false", default=True,
             help="do not record collectives, memory and steps for this cell"),
    argument("--no-watch", dest="watch", action="store_false", default=True,
             help="record, but show no live dashboard under the cell"),
    argument("--name", default=None, help="name this run for %%dist_compare (default: the strategy word; "
                                          "the line where a run of another line has the word, or where "
                                          "nbtool suggested the line)"),
)


def _strategy_options(f):
    """Options of %%distributed STRATEGY: generated from StrategySpec's fields (nbtool.spec), in sections."""
    decorators = []
    for group in OPTION_GROUPS:
        decorators.append(argument_group(group))
        for fld in OPTION_FIELDS:
            if fld.metadata["group"] == group:
                decorators += _option_arguments(fld)
    decorators += [argument_group("run options"), *RUN_OPTIONS]
    for d in reversed(decorators):  # IPython applies decorators in reverse source order
        f = d(f)
    return f


def parse_strategy_line(line: str, backend: str | None = None, device_kind: str = "cuda",
                        world_size: int | None = None):
    """The StrategySpec a ``%%distributed STRATEGY ...`` line (without ``%%distributed``) asks for."""
    args = parse_argstring(NbtoolMagics.distributed, line)
    if args.strategy not in STRATEGIES:
        raise UsageError(f"unknown strategy {args.strategy!r}; allowed: {', '.join(STRATEGIES)}")
    return strategy_spec(args, backend, device_kind, world_size)


@magics_class
class NbtoolMagics(Magics):
    """%cluster, %%distributed, %%rank, %dist_push, %dist_pull, %commbench, %dist_plan, %dist_checkpoint ..."""

    def __init__(self, shell):
        super().__init__(shell)
        from .actions.state import Session

        self.rank_cluster = None  # RankCluster, imported lazily (ipyparallel is slow to import)
        self.session = Session()  # what the kernel remembers between cells (recorded runs, last %commbench)

    # -- helpers ---------------------------------------------------------
    @property
    def in_kernel(self) -> bool:
        return getattr(self.shell, "kernel", None) is not None

    def recorded_name(self, text: str) -> str:
        """The recorded run ``text`` refers to: the run of that name, else the one run whose line is the
        %%distributed line ``text`` written another way (options in another order: the run of ``%%distributed
        pp --schedule zbv --microbatches 4`` is named ``pp --microbatches 4 --schedule zbv``, nbtool's
        order). ``text`` itself where neither is found: the lookup's error names it as written."""
        from .actions.metrics import run_line
        from .spec import SpecError, line_of

        if text in self.session.runs:
            return text
        try:
            args = parse_argstring(self.distributed, text)
            line = line_of(unchecked_spec(args)) if args.strategy in STRATEGIES else None
        except (UsageError, SpecError, ValueError, TypeError):  # not a strategy line
            return text
        same = [n for n, r in self.session.runs.items() if run_line(r) == line]
        return same[0] if len(same) == 1 else text

    def _require_cluster(self):
        if self.rank_cluster is None or not self.rank_cluster.running:
            raise UsageError(NO_CLUSTER)
        return self.rank_cluster

    # -- %cluster --------------------------------------------------------
    @magic_arguments()
    @argument("action", choices=["start", "status", "stop", "restart"], help="what to do")
    @argument("-n", type=positive_int, default=None, help="number of ranks (engines); default 2")
    @argument("--backend", choices=BACKENDS, default=None,
              help="process-group backend; auto = nccl with one GPU per rank if GPUs exist, else gloo")
    @argument("--gpus", default=None, help="GPU ids to use, one per rank, e.g. 0,1 or 0-3")
    @argument("--timeout", type=positive_seconds, default=None,
              help="seconds allowed for engines to start and join the process group (default 120)")
    @argument("--collective-timeout", type=positive_seconds, default=None, metavar="SECONDS",
              help="default for the hang watchdog: report a collective still running after SECONDS (60)")
    @argument("--engines", default=None, metavar="|".join(LAUNCHERS),
              help="ipyparallel's engine launcher: local (default), ssh (with --hosts), slurm, mpi")
    @argument("--hosts", default=None, metavar="HOST:N[,HOST:N]", help="ssh: N engines on each HOST")
    @argument("--profile", default=None, metavar="NAME",
              help="an ipyparallel profile: its launcher and controller settings, as they are")
    @argument("--interface", default=None, metavar="NAME",
              help="the network interface the hosts share, for the controller, rendezvous and collectives "
                   "(default: the one that reaches the first ssh host, or this host name's)")
    @argument("--ip", default=None, help="the controller's address (e.g. 0.0.0.0 on purpose: every interface)")
    @argument("--rendezvous", default=None, metavar="file:DIR|tcp",
              help="how the ranks meet across hosts: a FileStore in a directory every host sees, or a TCP "
                   "store on rank 0 (default across hosts)")
    @argument("--slurm-args", default=None, metavar="ARGS", help='sbatch options, e.g. "--partition=gpu --time=02:00:00"')
    @argument("--ssh-args", default=None, metavar="ARGS", help='ssh/scp options, e.g. "-F ./ssh_config"')
    @line_magic
    def cluster(self, line=""):
        """Start, inspect, stop or restart the cluster of ranks.

        ``%cluster start [-n N] [--backend auto|gloo|nccl] [--gpus 0,1] [--timeout S]``
        starts N ipyparallel engines that are torch.distributed ranks 0..N-1
        (one GPU each with nccl, or CPU ranks on gloo). On other machines:
        ``--engines ssh --hosts node1:2,node2:2``, ``--engines slurm
        [--slurm-args "..."]``, ``--engines mpi`` or ``--profile NAME``, with
        ``--interface NAME`` and ``--rendezvous file:DIR|tcp`` (README, "More
        than one machine"). Ranks are ordered by host; RANK, LOCAL_RANK,
        NODE_RANK ... are set on every engine.
        ``%cluster status`` shows a row per rank, ``%cluster stop`` ends it,
        ``%cluster restart`` brings up fresh engines with the same options.
        """
        from . import actions

        args = parse_argstring(self.cluster, line)
        # every option but the action is one of %cluster start's (argparse keeps them in the order declared)
        start_opts = ["-n" if k == "n" else "--" + k.replace("_", "-") for k, v in vars(args).items()
                      if k != "action" and v is not None]
        if args.action != "start" and start_opts:
            raise UsageError(f"{', '.join(start_opts)} only apply to %cluster start, not {args.action}")
        if args.action == "start":
            hosts = parse_hosts(args.hosts, args.n) if args.hosts else None
            opts = ClusterOptions(
                n=args.n or (sum(k for _, k in hosts) if hosts else 2),
                backend=args.backend or "auto",
                gpus=tuple(parse_int_list(args.gpus, "--gpus")) if args.gpus else None,
                timeout=args.timeout or 120.0,
                collective_timeout=args.collective_timeout or 60.0,
                engines=args.engines or ("ssh" if hosts else "local"),
                hosts=hosts, profile=args.profile, interface=args.interface, ip=args.ip,
                rendezvous=parse_rendezvous(args.rendezvous) if args.rendezvous else None,
                slurm_args=_unquoted(args.slurm_args or ""), ssh_args=_unquoted(args.ssh_args or ""),
            )
            check_launch(opts)
            if self.rank_cluster is not None and self.rank_cluster.running:
                raise UsageError(f"a cluster of {self.rank_cluster.world_size} rank(s) is already running; "
                                 "use %cluster restart for fresh engines, or %cluster stop first")
            self.rank_cluster = actions.cluster.start(opts, self.in_kernel)
        elif args.action == "status":
            return actions.cluster.status(self._require_cluster())
        elif args.action == "stop":
            if self.rank_cluster is None:
                raise UsageError("no cluster is running; nothing to stop")
            self.rank_cluster.stop()
            self.rank_cluster = None
        else:
            if self.rank_cluster is None:
                raise UsageError(NO_CLUSTER)
            self.rank_cluster.restart(actions.common.progress_line(self.in_kernel))

    # -- %%distributed / %%rank -------------------------------------------
    @magic_arguments()
    @argument("strategy", nargs="?", default=None,
              help="parallelism strategy to apply (see the list in the error for an unknown word)")
    @argument("--ranks", default=None, help="run only on these ranks, e.g. 0 or 0,2-3 (default: all)")
    @_strategy_options
    @_cell_options
    @no_var_expand
    @cell_magic
    def distributed(self, line, cell):
        """Run the cell on every rank (or ``--ranks``), blocking until all finish.

        Each rank keeps its own namespace between cells; ``rank``,
        ``world_size``, ``device``, ``torch`` and ``dist``
        (torch.distributed) are predefined there. Output streams live, then
        shows grouped by rank; an exception on any rank fails the cell.
        Ctrl-C interrupts every rank.

        With a strategy word (ddp, fsdp, zero1, zero2, zero3, tp, pp) the cell
        also gets ``strategy``: ``model, optimizer = strategy.prepare(model,
        optimizer)``, ``strategy.backward(loss)`` (or ``loss =
        strategy.forward_backward(x, y)``, required under pp),
        ``strategy.dataloader(dataset, batch_size=...)``, ``strategy.log(...)``,
        ``strategy.memory_ledger()``, ``strategy.full_state_dict()``,
        ``strategy.describe()``. Only the word changes between strategies.
        """
        if line.split()[:1] == ["compare"]:
            return self._compare(line, cell)
        args = parse_argstring(self.distributed, line)
        if args.strategy is not None and args.strategy not in STRATEGIES:
            raise UsageError(f"unknown strategy {args.strategy!r}; allowed: {', '.join(STRATEGIES)} "
                             "(or no word to run the cell as written)")
        if args.strategy is None:
            given = strategy_options_given(args)
            if given:
                raise UsageError(f"{given[0]} needs a strategy word first, e.g. %%distributed ddp {given[0]} ...")
            return self._run(cell, args.ranks, args)
        cluster = self._require_cluster()
        if args.ranks is not None:
            raise UsageError(f"--ranks does not apply with a strategy: {args.strategy} runs on every rank")
        spec = strategy_spec(args, cluster.layout.backend, cluster.layout.device_kind, cluster.layout.n)
        if spec.memory_timeline is not None and not args.metrics:
            raise UsageError("--memory-timeline is recorded with the run's metrics; drop --no-metrics")
        from . import actions

        actions.run.run_strategy(self.session, cluster, cell, spec, in_kernel=self.in_kernel, timeout=args.timeout,
                             quiet=args.quiet, export_config=args.export_config, metrics=args.metrics,
                             watch=args.watch, name=_unquoted(args.name) if args.name else None,
                             collective_timeout=args.collective_timeout)

    def _compare(self, line: str, cell: str):
        """%%distributed compare ddp, fsdp --precision bf16, zero3 --offload both"""
        import re

        from . import actions

        body = line.split(None, 1)[1] if len(line.split(None, 1)) > 1 else ""
        names = "|".join(STRATEGIES)
        segments = [seg.strip() for seg in re.split(rf",\s*(?=(?:{names})\b)", body) if seg.strip()]
        for seg in segments:  # a comma the split kept: the word after it is not a strategy
            stray = re.search(r",\s+([A-Za-z]\w*)", seg)
            if stray:
                raise UsageError(f"compare: {stray.group(1)!r} is not a strategy; allowed: {', '.join(STRATEGIES)}")
        if len(segments) < 2:
            raise UsageError("compare needs at least two runs, e.g. "
                             "%%distributed compare ddp, fsdp --precision bf16, zero3")
        cluster = self._require_cluster()
        runs, seen = [], set()
        timeout, quiet, collective_timeout = None, False, None
        for seg in segments:
            args = parse_argstring(self.distributed, seg)
            if args.strategy not in STRATEGIES:
                raise UsageError(f"compare: {seg!r} does not start with a strategy; allowed: {', '.join(STRATEGIES)}")
            for opt, bad in (("--ranks", args.ranks is not None), ("--no-metrics", not args.metrics),
                             ("--name", args.name is not None), ("--export-config", args.export_config)):
                if bad:
                    raise UsageError(f"compare: {opt} does not apply to a comparison ({seg!r})")
            # the run's name: the segment without the options that apply to the whole cell
            name = re.sub(r"\s*(--quiet|--no-watch|--(collective-)?timeout(\s+|=)\S+)", "", seg).strip()
            if name in seen:
                raise UsageError(f"compare: {name!r} is listed twice")
            seen.add(name)
            runs.append((name, strategy_spec(args, cluster.layout.backend, cluster.layout.device_kind, cluster.layout.n)))
            timeout = args.timeout if args.timeout is not None else timeout
            collective_timeout = args.collective_timeout or collective_timeout
            quiet = quiet or args.quiet
        actions.run.compare(self.session, cluster, cell, runs, in_kernel=self.in_kernel, timeout=timeout, quiet=quiet,
                        collective_timeout=collective_timeout)

    @magic_arguments()
    @argument("names", nargs="*", help="names of recorded runs (default: every run recorded in this kernel)")
    @argument("--deterministic", action="store_true",
              help="print only the columns that do not vary between runs (bytes)")
    @argument("--calibrate-on", default=None, metavar="NAME",
              help="the planner's errors with every run predicted from the recorded run NAME")
    @line_magic
    def dist_compare(self, line=""):
        """Compare recorded runs side by side: ``%dist_compare ddp fsdp zero3``.

        Runs are named by the strategy word (by their line where a run of
        another line has the word), by the segment of a ``%%distributed
        compare`` line, or by ``--name``; a run is also found by the line it
        ran under (``"tp --sp"`` for the run named ``tp``). Shows a table
        (model-state bytes per rank, comm bytes and collectives per step, step
        and comm time, final loss; ratios to the first run) and plots, then the
        planner's error on each run, predicted from the run before it (with
        ``--calibrate-on NAME``: every run from the recorded run NAME).
        Quote names with spaces: ``%dist_compare ddp "fsdp --wrap Block"``.
        """
        from . import actions

        args = parse_argstring(self.dist_compare, line)
        names = [n.strip("\"'") for n in args.names]  # magic_arguments keeps quotes
        runs = [self.recorded_name(n) for n in names]
        twice = next((n for i, n in enumerate(names) if runs[i] in runs[:i]), None)
        if twice is not None:
            raise UsageError(f"{twice!r} is listed twice")
        on = self.recorded_name(_unquoted(args.calibrate_on)) if args.calibrate_on else None
        actions.metrics.show_comparison(actions.metrics.stored_runs(self.session, runs), self.in_kernel,
                                        args.deterministic, self.session, on)

    @magic_arguments()
    @argument("action", choices=["export", "load"], help="what to do")
    @argument("path", help="export: file to write, .json (the whole run) or .csv (one row per record); "
                           "load: a .json export")
    @argument("--name", default=None,
              help="export: which recorded run (default: the last one); load: the name to record it under "
                   "(default: its own)")
    @line_magic
    def dist_metrics(self, line=""):
        """Export a recorded run, or load one back into this kernel's recorded runs.

        ``%dist_metrics export run.json`` writes it (read back in Python with
        nbtool.metrics.load); ``%dist_metrics load run.json [--name NAME]``
        records an exported run again, from this kernel or another, so that
        ``%dist_compare``, ``%dist_plan --vs`` and ``--calibrate-on`` take it.
        """
        from . import actions

        args = parse_argstring(self.dist_metrics, line)
        name = _unquoted(args.name) if args.name else None
        if args.action == "load":
            print(actions.metrics.load_run(self.session, _unquoted(args.path), name))
            return
        print(actions.metrics.export_run(self.session, args.path, name and self.recorded_name(name)))

    @magic_arguments()
    @argument("ranks", help="rank(s) to run on, e.g. 0 or 0,2-3")
    @_cell_options
    @no_var_expand
    @cell_magic
    def rank(self, line, cell):
        """Run the cell on the given rank(s) only: ``%%rank 0`` is ``%%distributed --ranks 0``."""
        args = parse_argstring(self.rank, line)
        return self._run(cell, args.ranks, args)

    def _run(self, cell, ranks_spec, args):
        from . import actions

        cluster = self._require_cluster()
        ranks = parse_ranks(ranks_spec, cluster.world_size)
        actions.run.run(cluster, cell, ranks, in_kernel=self.in_kernel, timeout=args.timeout, quiet=args.quiet,
                    collective_timeout=args.collective_timeout)

    # -- %commbench -----------------------------------------------------------
    @magic_arguments()
    @argument("ops", nargs="*", help="all_reduce (default), all_gather, reduce_scatter, broadcast, all_to_all")
    @argument("--sizes", default="4B:64MB", help="MIN:MAX (or one size), units B/KB/MB/GB (binary), default 4B:64MB")
    @argument("--factor", type=positive_number, default=2.0, help="size step factor (default 2)")
    @argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    @argument("--iters", type=positive_int, default=20, help="timed calls per batch (default 20)")
    @argument("--repeat", type=positive_int, default=5,
              help="passes over the sizes, one timed batch per size each (default 5): the time is "
                   "the median of a size's batches, min/max their spread")
    @argument("--min-batch-ms", type=float, default=0.0,
              help="more calls for sizes whose --iters calls take less than this (default 0: off); the "
                   "calls each size got are in the table's iters column")
    @argument("--warmup", type=int, default=5,
              help="untimed calls per size in the first pass (default 5; one before each later batch)")
    @argument("--ranks", default=None, help="benchmark a subset of ranks, e.g. 0,1 (default: all, and on several "
                                            "hosts each link apart too)")
    @argument("--inplace", action="store_true",
              help="all_gather / reduce_scatter in place (all_reduce and broadcast always are)")
    @argument("--label", default="", help="name for this result in tables and overlaid plots")
    @line_magic
    def commbench(self, line=""):
        """Measure collective latency and bandwidth on the running cluster, like nccl-tests.

        ``res = %commbench all_reduce all_gather --sizes 1KB:64MB``. For each op
        ``--repeat`` passes over the sizes time one batch of ``--iters`` calls
        per size (after warm-up calls), so a drift of the machine's speed moves
        every size alike and the first pass draws the whole curve; a batch's
        time is the slowest rank's mean per call, the reported time the median
        over a size's batches (their min/max shown as the spread); algbw = S/t,
        busbw = algbw x the nccl-tests factor; every result is checked (#wrong). Returns a
        CommbenchResult (table, ``.fits`` alpha-beta per op, ``.figure(*others)``
        to overlay results, ``.export(path)`` / ``CommbenchResult.load(path)``).
        On ranks of several hosts, without ``--ranks``, it then measures each
        link apart (intra-host: one host's ranks; inter-host: one rank per
        host) and returns a CommbenchLinks (``.part("inter-host")``), whose
        fits ``%dist_plan`` uses for each link.
        """
        from . import actions
        from .commbench import BENCH_OPS, DTYPES, size_sweep

        args = parse_argstring(self.commbench, line)
        ops = [o for part in args.ops for o in part.split(",") if o] or ["all_reduce"]
        for op in ops:
            if op not in BENCH_OPS:
                raise UsageError(f"unknown op {op!r}; allowed: {', '.join(BENCH_OPS)}")
        if len(set(ops)) != len(ops):
            raise UsageError(f"op listed twice in {' '.join(ops)!r}")
        if args.dtype not in DTYPES:
            raise UsageError(f"--dtype {args.dtype!r} is not known; allowed: {', '.join(DTYPES)}")
        if args.warmup < 0:
            raise UsageError(f"--warmup {args.warmup}: must be >= 0")
        if not 0 <= args.min_batch_ms <= 60_000:
            raise UsageError(f"--min-batch-ms {args.min_batch_ms:g}: must be between 0 (off) and 60000")
        try:
            sizes = size_sweep(args.sizes, args.factor)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if len(sizes) > 64:
            raise UsageError(f"--sizes {args.sizes} with --factor {args.factor:g} gives {len(sizes)} sizes; "
                             "use a larger --factor or a narrower range (at most 64)")
        cluster = self._require_cluster()
        ranks = parse_ranks(args.ranks, cluster.world_size) if args.ranks is not None else None
        if len(ranks or range(cluster.world_size)) < 2:
            raise UsageError(f"--ranks {args.ranks}: a collective benchmark needs at least 2 ranks")
        return actions.commbench.commbench(self.session, cluster, ops, sizes, args.dtype, args.iters, args.warmup, ranks,
                                 args.inplace, self.in_kernel, label=args.label, repeat=args.repeat,
                                 min_batch_s=args.min_batch_ms / 1e3)

    # -- %dist_plan -----------------------------------------------------------
    @magic_arguments()
    @argument("--model", default=None,
              help="a preset (nbtool.plan.MODEL_PRESETS), a parameter count (7e9, 1.3b, 722k), a variable holding "
                   "a model (counted on the meta device is fine) or a Hugging Face config, or a config .json path; "
                   "default: the last run's model, as it trained, else GPT-2 small")
    @argument("--hardware", default=None, help="a preset name; default: this cluster if one runs")
    @argument("--devices", type=positive_int, default=None, help="number of devices")
    @argument("--micro-batch", type=positive_int, default=None, help="default: the last run's, else 1")
    @argument("--seq", type=positive_int, default=None, help="default: the last run's, else the model's")
    @argument("--precision", choices=PRECISIONS, default=None, help="default: the last run's, else bf16")
    @argument("--checkpointing", choices=["none", "selective", "full"], default=None,
              help="default: the last run's, else none")
    @argument("--text", action="store_true", help="print the ranked recommendation instead of the widget")
    @argument("--vs-last", action="store_true", help="the last run's figures next to the planner's prediction")
    @argument("--vs", default=None, metavar="NAME", help="the recorded run NAME's figures next to the planner's")
    @argument("--calibrate-on", default=None, metavar="NAME",
              help="calibrate the planner on the recorded run NAME instead of the latest one")
    @argument("--deterministic", action="store_true",
              help="with --vs/--vs-last: only the figures that do not vary between runs (bytes)")
    @line_magic
    def dist_plan(self, line=""):
        """Recommend a strategy from the model size and the hardware, with the numbers behind it.

        Opens the picker widget in a notebook (``--text`` prints the ranking):
        predicted per-device memory per layout against the device's capacity,
        communication per step, and a ranked list with a reason per line;
        "Apply" writes the chosen ``%%distributed`` line into a new cell.
        ``--vs-last`` puts the last recorded run's figures (model states,
        bytes per step, peak tensor memory, step time and its split,
        throughput) next to the planner's prediction of that run, calibrated on
        the run before it; ``--vs NAME`` does so for the run called NAME.
        ``--calibrate-on NAME`` calibrates the planner on the recorded run NAME
        instead of the latest (for the ranking, and with ``--vs``: e.g. on a
        ddp cell run again after a slow spell). Without ``--model`` it plans the
        model the last run trained, as it trained it. Presets:
        ``nbtool.plan.inputs.MODEL_PRESETS`` and ``HARDWARE_PRESETS``;
        measured ``%commbench`` bandwidth is used when present.
        """
        from . import actions

        args = parse_argstring(self.dist_plan, line)
        given = (("--vs", args.vs), ("--calibrate-on", args.calibrate_on))
        names = {n: self.recorded_name(_unquoted(v)) for n, v in given if v}
        if args.vs_last and "--vs" in names:
            raise UsageError(f"--vs {names['--vs']!r} and --vs-last: give one (--vs-last is the last run)")
        if args.vs_last or "--vs" in names:
            # a recorded run is predicted from what its ranks recorded: the ranking's inputs do not apply
            ignored = [opt for opt, given in (("--model", args.model is not None), ("--hardware", args.hardware),
                                              ("--devices", args.devices), ("--micro-batch", args.micro_batch),
                                              ("--seq", args.seq), ("--precision", args.precision),
                                              ("--checkpointing", args.checkpointing)) if given]
            if ignored:
                raise UsageError(f"{ignored[0]} applies to the ranking, not to --vs/--vs-last: a recorded run is "
                                 "predicted from the model, batch and options its ranks recorded")
            return actions.plan.plan_vs(self.session, names.get("--vs"), names.get("--calibrate-on"),
                                        args.deterministic, self.in_kernel)
        if args.deterministic:
            raise UsageError("--deterministic applies with --vs NAME or --vs-last (the ranking has no measured "
                             "figures)")
        args.calibrate_on = names.get("--calibrate-on")
        req = actions.plan.request(args, self.shell.user_ns)  # resolved and checked before the cluster is asked
        return actions.plan.plan(self.session, req, self.rank_cluster, self.in_kernel, self.shell)

    # -- %dist_checkpoint -----------------------------------------------------
    @magic_arguments()
    @argument("action", choices=["save", "load"], help="what to do")
    @argument("path", help="checkpoint directory (created by save)")
    @argument("--no-optimizer", dest="optimizer", action="store_false", default=True,
              help="load: the model weights only")
    @line_magic
    def dist_checkpoint(self, line=""):
        """Save or load a checkpoint of the last strategy cell's model and optimizer on every rank.

        ``%dist_checkpoint save ckpt`` is ``strategy.save("ckpt")`` on every
        rank; ``%dist_checkpoint load ckpt`` loads the latest complete
        checkpoint into the prepared model (weights under any strategy; the
        optimizer state under the strategy and world size that saved it).
        Saves are atomic: a crash mid-save leaves the previous one loadable.
        """
        from . import actions

        args = parse_argstring(self.dist_checkpoint, line)
        if args.action == "save" and not args.optimizer:
            raise UsageError("--no-optimizer applies to load; save always writes the optimizer state")
        cluster = self._require_cluster()
        if args.action == "load":
            import os

            from .checkpoint_layout import latest_dir

            if latest_dir(args.path) is None:
                what = "does not exist" if not os.path.exists(args.path) else "holds no complete checkpoint"
                raise UsageError(f"checkpoint {args.path!r} {what}; save one with %dist_checkpoint save PATH")
        actions.checkpoint.checkpoint(cluster, args.action, args.path, args.optimizer)

    # -- %dist_push / %dist_pull -----------------------------------------
    @magic_arguments()
    @argument("names", nargs="+", help="kernel variables to copy to the ranks")
    @argument("--ranks", default=None, help="only these ranks, e.g. 0 or 0,2-3 (default: all)")
    @line_magic
    def dist_push(self, line=""):
        """Copy kernel variables into every rank's namespace (or ``--ranks``)."""
        from . import actions

        args = parse_argstring(self.dist_push, line)
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"{missing[0]!r} is not defined in the kernel; define it before %dist_push")
        cluster = self._require_cluster()
        ranks = parse_ranks(args.ranks, cluster.world_size)
        actions.transfer.push(cluster, {n: self.shell.user_ns[n] for n in args.names}, ranks)

    @magic_arguments()
    @argument("names", nargs="+", help="rank variables to copy into the kernel")
    @argument("--rank", type=rank_number, default=None,
              help="take the value from this rank; without it each name becomes a list indexed by rank")
    @line_magic
    def dist_pull(self, line=""):
        """Copy rank variables into the kernel.

        ``%dist_pull loss --rank 0`` sets ``loss`` to rank 0's value;
        ``%dist_pull loss`` sets ``loss`` to ``[value on rank 0, value on rank 1, ...]``.
        """
        from . import actions

        args = parse_argstring(self.dist_pull, line)
        cluster = self._require_cluster()
        if args.rank is not None and args.rank >= cluster.world_size:
            raise UsageError(f"--rank {args.rank} does not exist; this cluster has ranks "
                             f"{format_ranks(range(cluster.world_size))}")
        values = actions.transfer.pull(cluster, args.names, args.rank)
        self.shell.user_ns.update(values)
