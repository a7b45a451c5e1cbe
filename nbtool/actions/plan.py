"""%dist_plan: the picker, the ranked recommendation as text, and predicted against measured (--vs)."""
from __future__ import annotations

from dataclasses import dataclass

from IPython.core.error import UsageError

from .state import Session


DEFAULT_MODEL = "GPT-2 small (124M)"  # planned when no --model is given and this kernel recorded no run


@dataclass(frozen=True)
class PlanRequest:
    """What %dist_plan was asked, with presets already resolved by the magic (see ``request``). Training
    fields left None were not given: the last run's when its model is planned, else Training's defaults."""

    model_name: str | None = None  # a MODEL_PRESETS name (used when shape is None); None: --model not given
    shape: object = None  # a ModelShape from a parameter count
    hardware: object = None  # a Hardware preset; None: this cluster's, detected, if one runs
    devices: int | None = None
    micro_batch: int | None = None
    seq: int | None = None
    precision: str | None = None
    checkpointing: str | None = None
    text: bool = False  # the ranking as text instead of the picker
    calibrate_on: str | None = None  # a recorded run's name: its calibration instead of the latest run's

    def training(self, base=None):
        """The Training planned: what was given, the rest from ``base`` (the last run's) or the defaults."""
        from dataclasses import replace

        from ..plan.inputs import Training

        given = {k: v for k in ("micro_batch", "seq", "precision", "checkpointing")
                 if (v := getattr(self, k)) is not None}
        return replace(base or Training(), **given)


def request(args, user_ns: dict | None = None) -> PlanRequest:
    """The typed request of a parsed %dist_plan line: presets by forgiving names, counts like 7e9 or 1.3b,
    a kernel variable holding a module or a Hugging Face config, or a config JSON file."""
    from ..plan.inputs import HARDWARE_PRESETS, MODEL_PRESETS

    hw = HARDWARE_PRESETS[_preset(args.hardware, HARDWARE_PRESETS, "--hardware")] if args.hardware else None
    model_name, shape = None, None
    if args.model is not None:
        shape = model_shape(args.model, user_ns or {}, args.seq)
        if shape is None:
            model_name = _preset(args.model, MODEL_PRESETS, "--model", hint=MODEL_FORMS)
    return PlanRequest(model_name, shape, hw, args.devices, args.micro_batch, args.seq, args.precision,
                       args.checkpointing, args.text, args.calibrate_on)


def last_run_model(state: Session):
    """(run, ModelShape, Training) of the latest recorded run that prepared a model, or None: what
    %dist_plan plans when no --model is given, as that run trained it (micro-batch, sequence, precision,
    optimizer, checkpointing), so the ranking is of the user's own model rather than a preset."""
    from dataclasses import replace

    from ..plan.versus import planner_inputs

    run = state.last
    if run is None or state.runs.get(run.name) is not run or not run.description.param_numels:
        return None
    _, shape, training, _, pp = planner_inputs(run)
    samples = (run.description.batch or {}).get("samples") or 1
    # a pipeline run's micro-batches and gradient accumulation belong to its layout, not to the model
    training = replace(training, micro_batch=samples, grad_accum=1) if pp > 1 else training
    return run, replace(shape, name=f"the model of run {run.name!r}"), training


MODEL_FORMS = ("or a parameter count (7e9, 1.3b, 722k), a variable holding a model or a Hugging Face config, "
               "or a config .json path")
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def model_shape(text: str, user_ns: dict, seq: int | None = None):
    """The ModelShape ``--model TEXT`` names, or None for a preset name (looked up by the caller)."""
    import os

    from ..plan.inputs import ModelShape, format_count

    t = text.strip()
    number = t[:-1] if t[-1:].lower() in _SUFFIX else t
    try:
        count = float(number) * _SUFFIX.get(t[-1:].lower(), 1)
    except ValueError:
        count = None
    if count is not None:
        if count < 1:
            raise UsageError(f"--model {text!r}: the parameter count must be >= 1")
        return ModelShape(int(count), name=f"{format_count(int(count))} params")
    if t.isidentifier() and t in user_ns:
        return _shape_of(user_ns[t], t, seq)
    if t.endswith(".json"):
        if not os.path.isfile(t):
            raise UsageError(f"--model {text!r}: no such file")
        import json

        with open(t) as f:
            data = json.load(f)
        return _shape_of(data, os.path.basename(t), seq)
    return None


def _shape_of(obj, label: str, seq):
    from torch import nn

    from ..plan.inputs import ModelShape

    if isinstance(obj, nn.Module):
        return ModelShape.from_module(obj, seq=seq, name=f"{label} ({type(obj).__name__})")
    if isinstance(obj, dict) and "model_type" in obj:
        from transformers import AutoConfig

        fields = {k: v for k, v in obj.items() if k != "model_type"}
        obj = AutoConfig.for_model(obj["model_type"], **fields)
    if hasattr(obj, "model_type") and hasattr(obj, "to_dict"):
        try:
            return ModelShape.from_config(obj, seq=seq, name=f"{label} ({obj.model_type})")
        except Exception as e:  # not a causal LM transformers can build
            raise UsageError(f"--model {label}: transformers cannot build a causal LM from this config "
                             f"({type(e).__name__}: {e})") from None
    raise UsageError(f"--model {label}: a {type(obj).__name__}, not a torch module, a Hugging Face config "
                     "or a config dict with model_type")


def plan(state: Session, req: PlanRequest, cluster, in_kernel: bool, shell):
    """%dist_plan: the picker widget, or the ranked recommendation as text."""
    from ..plan.inputs import HARDWARE_PRESETS, MODEL_PRESETS
    from ..plan.recommend import emulated_bf16_note, recommend, runnable_choices

    hw = req.hardware
    running = cluster is not None and cluster.running
    if req.calibrate_on and (hw is not None or not running):
        raise UsageError(f"--calibrate-on {req.calibrate_on!r}: a run calibrates this cluster's figures; "
                         + ("drop --hardware" if hw is not None else "no cluster is running (%cluster start)"))
    calibration = calibration_on(state, req.calibrate_on) if req.calibrate_on else state.calibration
    measured_text = ""  # which of this cluster's figures were measured, and on what
    if hw is None and running:
        from ..plan.detect import hardware_from_facts
        from ..rank.bootstrap import hardware_facts

        facts = cluster.view([0]).apply_sync(hardware_facts)[0]
        hw = hardware_from_facts(facts, cluster.world_size, cluster.layout.backend, cluster.places)
        measured = []
        why = _misfit(calibration, hw) if calibration is not None else ""
        if why and req.calibrate_on:
            raise UsageError(f"--calibrate-on {req.calibrate_on!r}: {why}")
        if why:  # the latest run's calibration does not fit this cluster (another was started since)
            calibration = None
        if calibration is not None:
            from dataclasses import replace

            cal, name, _ = calibration
            hw = replace(hw, intra_latency=cal.intra_latency, intra_bw=cal.intra_bw, peak_flops=cal.peak_flops,
                         host_speed=cal.host_speed if hw.host_speed is not None else None,
                         matmul_flops=cal.matmul_flops or hw.matmul_flops,
                         op_links=cal.op_links, measured=True)
            measured.append(f"{cal.name} from run {name!r}")
        if state.commbench is not None and "all_reduce" in state.commbench.fits:
            hw = hw.with_commbench(state.commbench)
            links = [r.link for r in state.commbench.parts if r.link]
            measured.append(f"{' and '.join(links) + ' links' if links else 'link'} from the last %commbench "
                            "all_reduce fit")
        if measured:
            measured_text = ("measured on this cluster: " + "; ".join(measured)
                             + " (device memory from the ranks' own report; host link: preset)")
            if req.text:
                print(measured_text)
    shape, training = req.shape, req.training()
    if shape is None and req.model_name is None:
        latest = last_run_model(state)
        if latest is not None:
            run, shape, base = latest
            training = req.training(base)
            print(f"planning the model run {run.name!r} trained, with its micro-batch, sequence and precision "
                  "where not given (--model for another)")
    if in_kernel and not req.text:
        from ..widgets.picker import Picker

        counted = shape is not None and shape.layers is not None  # a module or config: offered by its name
        model = (req.model_name or DEFAULT_MODEL) if shape is None else "custom"
        picker = Picker(hardware=hw, model=model, shell=shell, shape=shape if counted else None, measured=measured_text)
        with picker.quiet():  # one chart update after all inputs are set
            if shape is not None and not counted:
                picker.custom_params.value = shape.params / 1e9
            if req.devices:
                picker.devices.value = req.devices
            picker.micro_batch.value = training.micro_batch
            picker.seq.value = training.seq or 0
            picker.precision.value = training.precision
            picker.checkpointing.value = training.checkpointing
        picker.update()
        picker.show()
        return None
    hw = hw or HARDWARE_PRESETS["8x A100-80GB NVLink"]
    if req.devices:
        hw = hw.with_devices(req.devices)
    shape = shape or MODEL_PRESETS[req.model_name or DEFAULT_MODEL]
    rec = recommend(shape, training, hw)
    tag = ", partly measured: the line above" if hw.measured else ""
    from ..plan.inputs import format_count, format_gb

    # decimal GB as in the lines below ("38.7 GB usable" of a 40 GiB card), the card's GiB beside it
    print(f"{shape.name or shape.params}: {format_count(shape.params)} parameters on {hw.devices} x "
          f"{format_gb(hw.device_memory)} = {hw.device_memory / 2**30:.0f} GiB ({hw.name}{tag}); "
          f"{training.precision}, micro-batch {training.micro_batch}, checkpointing {training.checkpointing}")
    for i, line in enumerate(rec.lines(), 1):
        print(f"{i:>2}. {line}")
    choices = runnable_choices(rec, training)
    if choices:
        print(f"run it: %%distributed {choices[0].magic_line(training)}")
    note = emulated_bf16_note(shape, training, hw, rec)
    if note:
        print(f"note: {note}")
    return None


def _misfit(calibration: tuple, hw) -> str:
    """Why a calibration (Hardware, name, run) cannot stand for this cluster's ``hw``, or ""."""
    from ..plan.versus import ran_on_cpu

    cal, _, run = calibration
    cpu = hw.host_speed is not None  # CPU ranks: the host-cost model's speed
    if not cal.measured:
        return "that run measured no link and no compute rate"
    if cal.devices_per_node != hw.devices_per_node:
        return f"that run had {cal.devices_per_node} ranks per host, this cluster {hw.devices_per_node}"
    if ran_on_cpu(run) != cpu:
        kinds = ("GPUs", "CPU ranks") if cpu else ("CPU ranks", "GPUs")
        return f"that run was on {kinds[0]}, this cluster's ranks are {kinds[1]}"
    return ""


def _preset(text: str, table: dict, option: str, hint: str = "") -> str:
    """A preset by a forgiving name: case, spaces and punctuation ignored; a unique fragment is enough."""
    norm = lambda x: "".join(ch for ch in x.lower() if ch.isalnum())
    key = norm(text)
    hits = [name for name in table if norm(name) == key] or [name for name in table if key and key in norm(name)]
    if len(hits) != 1:
        what = "matches several presets" if hits else "is not a preset"
        raise UsageError(f"{option} {text!r} {what}; presets: {', '.join(table)}{' ' + hint if hint else ''}")
    return hits[0]


def plan_vs(state: Session, name: str | None = None, on: str | None = None, deterministic: bool = False,
            in_kernel: bool = False) -> None:
    """``%dist_plan --vs NAME`` (``--vs-last``: the last run, failed ones too): that run's figures next to the
    planner's (nbtool.plan.versus), calibrated as it was under its cell, or on run ``on``
    (``--calibrate-on``)."""
    if name is not None:
        run = _named_run(state, name, "--vs")
    elif state.last is None:
        raise UsageError("no recorded run yet; run a %%distributed STRATEGY cell first")
    else:
        run = state.last
    calibration = calibration_on(state, on) if on is not None else None
    if calibration is not None:
        same_device_kind(calibration, [run])
    try:
        result = versus_for(state, run, calibration)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if state.runs.get(run.name) is not run:  # --vs-last on a run that raised: kept for inspection only
        print(f"the last run, {run.name!r}, failed: its figures are as far as it got (not recorded for "
              "%dist_compare or --vs)")
    show_versus(result, in_kernel, deterministic)


def show_versus(result, in_kernel: bool, deterministic: bool = False) -> None:
    """The predicted-vs-measured table: in a notebook an HTML table (as text its rows, 150-200 characters,
    wrapped at the output's width and lost their columns), the text with it; text elsewhere, and with
    ``deterministic`` (outputs that are checked, as %dist_compare's)."""
    if deterministic or not in_kernel:
        print(result.text(deterministic=deterministic))
        return
    from IPython.display import display

    from ..widgets.versus_table import versus_html

    display({"text/plain": result.text(), "text/html": versus_html(result)}, raw=True)


def calibration_on(state: Session, name: str) -> tuple:
    """(Hardware, name, run): the planner calibrated on the recorded run ``name``, as ``after_run`` would
    (a bf16 run on CPU ranks keeps the latest calibration's host speed, which it cannot tell)."""
    from ..plan.versus import calibrate

    run = _named_run(state, name, "--calibrate-on")
    if state.calibration is not None and state.calibration[2] is run:
        return state.calibration
    if not run.description.param_numels:
        raise UsageError(f"--calibrate-on {name!r}: that cell never called strategy.prepare, so there is no "
                         "model to calibrate on")
    before = state.calibration[0].host_speed if state.calibration is not None else None
    return calibrate(run, host_speed=before), run.name, run


def same_device_kind(calibration: tuple, runs: list) -> None:
    """Refuses a calibration on CPU ranks for runs on GPUs, or the other way round: a CPU run calibrates
    the host-cost model (nbtool.plan.cpu_costs), a GPU run a FLOP rate, and neither carries over."""
    from ..plan.versus import ran_on_cpu

    kind = lambda run: "CPU ranks" if ran_on_cpu(run) else "GPUs"
    other = [r.name for r in runs if kind(r) != kind(calibration[2])]
    if other:
        raise UsageError(f"--calibrate-on {calibration[1]!r}: that run was on {kind(calibration[2])}, "
                         f"{', '.join(map(repr, other))} on {kind(next(r for r in runs if r.name == other[0]))}; "
                         "a calibration carries over only to runs on the same kind of device")


def _named_run(state: Session, name: str, option: str):
    from .metrics import stored_runs

    try:
        return stored_runs(state, [name])[0]
    except UsageError as e:
        raise UsageError(f"{option} {name!r}: {e}") from None


def versus_for(state: Session, run, calibration: tuple | None = None):
    """The planner's prediction of ``run`` with the best hardware figures this kernel has: the
    calibration of the run before it (else of this run itself), or ``calibration`` ((Hardware, name,
    run) from ``calibration_on``), with %commbench's link fit."""
    from ..plan.versus import calibrate, ran_on_cpu, versus, with_timeline

    if calibration is None:
        cached = state.versus.get(run.name)
        if cached is not None and cached.run is run:
            return cached  # as predicted when it ran, before the planner was calibrated on it
        calibration = state.calibration
    on = None  # the calibration run's name
    if calibration is not None and calibration[2] is not run:  # the run before, even of the same name
        on = calibration[1]
        hw, source = calibration[0], f"calibrated on run {on!r}" + (
            " (the one before this)" if calibration[1] == run.name else "")
        timed = [with_timeline(r) for r in (calibration[2], run)]
        if timed[0] != timed[1]:  # the timeline's bookkeeping in one's times and not the other's
            source += (", a --memory-timeline run: its bookkeeping is in the compute rate" if timed[0] else
                       ", a run without --memory-timeline: this one's times hold the timeline's bookkeeping")
    else:
        # on CPU ranks an op the run timed in too few sizes to fit a link keeps the in-training table
        # (nbtool.plan.versus.ddp_buckets_link says why): the deep FSDP's step read +29% calibrated on itself
        hw, source = calibrate(run), ("calibrated on this run (its compute fits by construction; its "
                                      + ("collectives: their own link where they fit one, DDP's buckets their "
                                         "in-flight union, else the CPU ranks' in-training table)" if ran_on_cpu(run)
                                         else "communication is the link fit of its own collectives)"))
    if state.commbench is not None and "all_reduce" in state.commbench.fits:
        hw, source = hw.with_commbench(state.commbench), source + "; link from %commbench"
    return versus(run, hw, source, on, calibration[2] if on is not None else None)


def after_run(state: Session, run, show: bool, in_kernel: bool = False) -> None:
    """After a good strategy run: its predicted-vs-measured table, what became of advice it followed,
    new advice; then calibrate the planner on it."""
    from ..plan.advice import followed, suggest
    from ..plan.versus import calibrate, spec_of
    from ..spec import line_of

    if not run.description.param_numels:
        return  # the cell never called strategy.prepare
    result = state.versus[run.name] = versus_for(state, run)
    line = line_of(spec_of(run))
    taken = [s for s in state.advice if s.line == line]
    state.advice = suggest(run, result)
    if show:
        show_versus(result, in_kernel)
        for s in taken:
            print(followed(run, s))
        for i, s in enumerate(state.advice, 1):
            print(s.text(i))
    # a bf16 run on CPU ranks keeps the run before's host speed (nbtool.plan.versus.calibrate)
    before = state.calibration[0].host_speed if state.calibration is not None else None
    state.calibration = (calibrate(run, host_speed=before), run.name, run)
