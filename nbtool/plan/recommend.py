"""Rank the layouts that fit, with a reason per line; say what would make one fit if none does."""
from __future__ import annotations

from dataclasses import dataclass, field

from .estimate import RESERVE, Estimate, estimate
from .layouts import DP_LAYOUTS, PP, PREFERENCE, TP, TP_PP, Layout
from .inputs import Hardware, ModelShape, Training
from .inputs import format_gb as _gb
from .inputs import format_ms as _ms

TIE = 0.10  # step-time estimates within 10% of the best count as a tie: the simpler layout wins


def candidate_layouts(m: ModelShape, hw: Hardware) -> list[tuple[Layout, int, int]]:
    """(layout, tp, pp): every data-parallel layout, plus tensor x pipeline splits the shape allows."""
    out = [(lay, 1, 1) for lay in DP_LAYOUTS]
    if m.layers and m.heads and m.hidden:
        for tp in (2, 4, 8):
            if tp > hw.devices_per_node or m.heads % tp or hw.devices % tp:
                continue
            for pp in (1, 2, 4, 8, 16):
                if hw.devices % (tp * pp) or m.layers % pp:
                    continue
                out.append((TP if pp == 1 else TP_PP, tp, pp))
        for pp in (2, 4, 8):
            if hw.devices % pp == 0 and m.layers % pp == 0:
                out.append((PP, 1, pp))
    return out


@dataclass
class Recommendation:
    ranked: list = field(default_factory=list)  # fitting Estimates, best first
    rejected: list = field(default_factory=list)  # Estimates that do not fit
    reasons: dict = field(default_factory=dict)  # id(estimate) -> reason line
    advice: list = field(default_factory=list)  # when nothing fits

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def lines(self) -> list[str]:
        out = [self.reasons[id(e)] for e in self.ranked]
        out += [self.reasons[id(e)] for e in self.rejected]
        return out + self.advice

    def __str__(self) -> str:
        return "\n".join(self.lines())


def recommend(m: ModelShape, t: Training, hw: Hardware, advise: bool = True) -> Recommendation:
    """Estimate every candidate layout, keep those that fit, rank by time per sample then simplicity.

    Layouts within 10% of the fastest estimate tie, and the simplest of them
    comes first (``estimate.PREFERENCE``: DDP, FSDP grad-op, ZeRO-2, ZeRO-1,
    FSDP full shard, ZeRO-3, tensor/pipeline splits, then offload): the
    estimates are not finer than that.
    """
    ests = [estimate(name, m, t, hw, tp, pp) for name, tp, pp in candidate_layouts(m, hw)]
    # FSDP accumulating micro-batches holds every unit's gradients unsharded in fp32: where that does not
    # fit, the same layout reduce-scattering each micro-batch's (more bytes a step) may
    ests += [estimate(e.layout, m, t, hw, e.tp, e.pp, reduce_every_micro_batch=True) for e in ests
             if t.grad_accum > 1 and e.pp == 1 and (e.layout.is_fsdp or e.dp_sharded) and not e.fits]
    fit = [e for e in ests if e.fits]
    bad = [e for e in ests if not e.fits]
    rec = Recommendation()
    if fit:
        best = min(e.time_per_sample for e in fit)
        fit.sort(key=lambda e: (e.time_per_sample > best * (1 + TIE), PREFERENCE.index(e.layout), e.tp * e.pp,
                                e.time_per_sample))
    rec.ranked = fit
    rec.rejected = sorted(bad, key=lambda e: e.device_total)
    ddp = next((e for e in ests if e.layout == "ddp"), None)
    for e in fit:
        parts = [f"{_label(e)} fits with {e.headroom:.0%} headroom ({_gb(e.device_total)} of {_gb(e.capacity)} "
                 f"per device: {_split(e)})"]
        if ddp is not None and e is not ddp and ddp.comm_bus_bytes:
            parts.append(f"communication x{e.comm_bus_bytes / ddp.comm_bus_bytes:.2f} DDP's")
        parts.append(f"est. {_ms(e.time_per_sample)} ms per sample; step {_ms(e.step_s)} ms (compute {_ms(e.compute_s)}, "
                     f"exposed comm {_ms(e.exposed_comm_s)}" + (f", bubble {_ms(e.bubble_s)}" if e.bubble_s else "")
                     + (f", offload {_ms(e.offload_s)}" if e.offload_s else "") + ")")
        if e.host:
            parts.append(f"host {_gb(e.host)} of {_gb(e.host_capacity)} per node")
        rec.reasons[id(e)] = "; ".join(parts + e.notes)
    for e in bad:
        why = (f"needs {_gb(e.device_total)} > {_gb((1 - RESERVE) * e.capacity)} usable per device ({_split(e)})"
               if e.device_total > (1 - RESERVE) * e.capacity else
               f"needs {_gb(e.host)} of host memory per node > {_gb(e.host_capacity)}")
        rec.reasons[id(e)] = f"{_label(e)} does not fit: {why}"
    if not fit and advise:
        rec.advice = _advice(m, t, hw, ests)
    return rec


def emulated_bf16_note(m: ModelShape, t: Training, hw: Hardware, rec: "Recommendation") -> str:
    """For a bf16 request on CPU ranks that emulate bf16: that sentence, with the best fp32 layout's
    predicted step next to the best bf16 one's (for %dist_plan's text and the picker); else ""."""
    from dataclasses import replace

    emulated = hw.emulated_bf16() if t.precision == "bf16" else ""
    if not emulated or rec.best is None:
        return ""
    fp32 = recommend(m, replace(t, precision="fp32"), hw, advise=False).best
    if fp32 is None:
        return ""
    return (f"{emulated}; with --precision fp32 the best choice's step is predicted at {fp32.step_s * 1e3:.0f} ms, "
            f"against {rec.best.step_s * 1e3:.0f} ms")


def runnable_choices(rec: "Recommendation", t: Training) -> list:
    """The fitting layouts nbtool can run as they are, best first (their options validate)."""
    from ..spec import SpecError, validate

    out = []
    for e in rec.ranked:
        try:
            validate(e.spec(t), None, "cuda")
        except SpecError:
            continue
        out.append(e)
    return out


def _label(e: Estimate) -> str:
    label = (e.layout.label if not e.layout.mesh else
             f"Megatron TP {e.tp} x PP {e.pp} x {'FSDP' if e.dp_sharded else 'DP'} {e.dp}")
    return label + (", reducing every micro-batch" if e.reduce_every_micro_batch else "")


def _split(e: Estimate) -> str:
    ordered = sorted(e.device.items(), key=lambda kv: kv[0] == "workspace")  # the libraries' share last
    return ", ".join(f"{k} {_gb(v)}" for k, v in ordered if v) + (f", at the {e.peak_phase}" if e.peak_phase else "")


def _advice(m: ModelShape, t: Training, hw: Hardware, ests: list[Estimate]) -> list[str]:
    """Try the usual remedies, cumulatively, and report the first setup where something fits."""
    closest = min(ests, key=lambda e: e.device_total)
    out = [f"Nothing fits; the closest is {_label(closest)} at {_gb(closest.device_total)} per device."]
    changes, tt = [], t
    steps = []
    if t.checkpointing != "full":
        tt = Training(**{**tt.__dict__, "checkpointing": "full"})
        changes.append("full activation checkpointing")
        steps.append((list(changes), tt, hw))
    if t.micro_batch > 1:
        tt = Training(**{**tt.__dict__, "micro_batch": 1})
        changes.append("micro-batch 1")
        steps.append((list(changes), tt, hw))
    for factor in (2, 4, 8, 16, 32, 64):
        steps.append((changes + [f"{hw.devices * factor} devices"], tt, hw.scaled(nodes=hw.nodes * factor)))
    for what, t2, hw2 in steps:
        r = recommend(m, t2, hw2, advise=False)
        if r.best is not None:
            out.append(f"With {', '.join(what)}: {_label(r.best)} would fit "
                       f"({_gb(r.best.device_total)} per device).")
            break
    else:
        out.append("Even 64x the devices with full checkpointing and micro-batch 1 would not fit: "
                   "a larger device or a smaller model is needed.")
    return out
