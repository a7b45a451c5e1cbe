"""%dist_plan: the picker, the ranked recommendation as text, and predicted against measured (--vs-last)."""
from __future__ import annotations

from dataclasses import dataclass

from IPython.core.error import UsageError

from .state import Session


@dataclass(frozen=True)
class PlanRequest:
    """What %dist_plan was asked, with presets already resolved by the magic (see ``request``)."""

    model_name: str = "GPT-2 small (124M)"  # a MODEL_PRESETS name (used when shape is None)
    shape: object = None  # a ModelShape from a parameter count
    hardware: object = None  # a Hardware preset; None: this cluster's, detected, if one runs
    devices: int | None = None
    training: object = None  # a Training
    text: bool = False  # the ranking as text instead of the picker


def request(args) -> PlanRequest:
    """The typed request of a parsed %dist_plan line: presets by forgiving names, counts like 7e9."""
    from ..plan.inputs import HARDWARE_PRESETS, MODEL_PRESETS, ModelShape, Training

    hw = HARDWARE_PRESETS[_preset(args.hardware, HARDWARE_PRESETS, "--hardware")] if args.hardware else None
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
    training = Training(micro_batch=args.micro_batch, seq=args.seq, precision=args.precision,
                        checkpointing=args.checkpointing)
    return PlanRequest(model_name, shape, hw, args.devices, training, args.text)


def plan(state: Session, req: PlanRequest, cluster, in_kernel: bool, shell):
    """%dist_plan: the picker widget, or the ranked recommendation as text."""
    from ..plan.inputs import HARDWARE_PRESETS, MODEL_PRESETS
    from ..plan.recommend import recommend, runnable_choices

    hw = req.hardware
    if hw is None and cluster is not None and cluster.running:
        from ..plan.detect import hardware_from_facts
        from ..rank.bootstrap import hardware_facts

        facts = cluster.view([0]).apply_sync(hardware_facts)[0]
        hw = hardware_from_facts(facts, cluster.world_size, cluster.layout.backend)
        if state.commbench is not None and "all_reduce" in state.commbench.fits:
            hw = hw.with_commbench(state.commbench)
    shape, training = req.shape, req.training
    if in_kernel and not req.text:
        from ..widgets.picker import Picker

        picker = Picker(hardware=hw, model=req.model_name if shape is None else "custom", shell=shell)
        with picker.quiet():  # one chart update after all inputs are set
            if shape is not None:
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
    shape = shape or MODEL_PRESETS[req.model_name]
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


def plan_vs_last(state: Session) -> None:
    """Predicted (nbtool.plan) vs measured (memory ledger) model states for the last recorded run."""
    from ..plan.estimate import estimate
    from ..plan.inputs import Hardware, ModelShape, Training
    from ..run_analysis import peak_ledger

    if state.last is None:
        raise UsageError("no recorded run yet; run a %%distributed STRATEGY cell first")
    run = state.last
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
