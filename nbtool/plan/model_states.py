"""Model-state bytes per rank, from first principles, for each strategy nbtool runs.

The ZeRO paper (Rajbhandari et al., 2020, section 3) counts model states for
mixed-precision Adam as 2 + 2 + K bytes per parameter (fp16 weights, fp16
gradients, K = 12 for the fp32 master copy, momentum and variance), and
divides them across Nd data-parallel ranks stage by stage:

    DDP      (2 + 2 + K) Psi
    ZeRO-1   2 Psi + 2 Psi + K Psi / Nd
    ZeRO-2   2 Psi + (2 + K) Psi / Nd
    ZeRO-3   (2 + 2 + K) Psi / Nd

``paper_bytes`` is exactly that table. ``expected_ledger`` predicts what
``strategy.memory_ledger()`` measures for nbtool's implementations, which
differ from the paper in known, documented ways:

- DDP and FSDP with bf16 use autocast / MixedPrecisionPolicy: the weights,
  gradients and Adam state stay fp32 (4 + 4 + 8 = 16 bytes per parameter,
  the paper's total with a different split).
- DeepSpeed keeps an fp32 master partition even in fp32 training, and at the
  step boundary stage 1 already holds only its gradient partition (the full
  gradients exist during backward only), so stages 1 and 2 hold the same.
- DeepSpeed pads flat buffers (stages 1-2: to a multiple of 2 * Nd elements;
  stage 3: each parameter to a multiple of Nd), and stage 3 keeps parameters
  of at most ``stage3_param_persistence_threshold`` elements whole on every
  rank as well as partitioned.
- Adam's per-tensor step counters (4-byte scalars) are counted under "other".

FSDP2 shards each parameter along dim 0; when dim 0 is not divisible by Nd,
its shards are padded and the per-rank figures here are off by that padding.
"""
from __future__ import annotations

import math

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def paper_bytes(stage: int, psi: int, nd: int, k: int = 12) -> dict:
    """The ZeRO paper's per-device model states (mixed-precision Adam): params, grads, optimizer."""
    full = {"params": 2 * psi, "grads": 2 * psi, "optimizer_state": k * psi}
    if stage >= 1:
        full["optimizer_state"] = k * psi / nd
    if stage >= 2:
        full["grads"] = 2 * psi / nd
    if stage >= 3:
        full["params"] = 2 * psi / nd
    return full


# DeepSpeed's default stage3_param_persistence_threshold: ZeRO-3 keeps smaller tensors whole on every rank
PERSISTENCE_THRESHOLD = 100_000


# fp32 optimizer state per parameter element
OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd-momentum": 4, "sgd": 0}


def expected_ledger(strategy: str, precision: str, numels: list[int], nd: int, *,
                    offload: str | None = None, persistence_threshold: int = PERSISTENCE_THRESHOLD,
                    optimizer: str = "adam", whole: int = 0) -> dict:
    """Bytes per rank by ledger category for ``strategy`` on parameters of sizes ``numels``.

    ``optimizer``: "adam" (exp_avg + exp_avg_sq: 8 bytes per element, plus a
    step scalar per tensor the optimizer holds), "sgd-momentum" (a momentum
    buffer: 4 bytes per element) or "sgd" (no state); ``whole``:
    elements of those parameters fsdp keeps whole on every rank (--replicate).
    """
    psi = sum(numels)
    w = DTYPE_BYTES[precision]
    state_per_elem = OPTIMIZER_STATE_BYTES[optimizer]
    out = dict(params=0, grads=0, master_params=0, optimizer_state=0, other=0)
    if strategy in ("ddp", "fsdp"):
        shard = psi if strategy == "ddp" else sum(n / nd for n in numels) + whole * (1 - 1 / nd)
        out.update(params=4 * shard, grads=4 * shard, optimizer_state=state_per_elem * shard)
        if optimizer == "adam":
            out["other"] = 4 * len(numels)  # one fp32 step counter per parameter tensor
        return out
    if strategy in ("zero1", "zero2"):
        flat = _round_up(psi, 2 * nd)
        part = flat // nd
        grad_bytes = 4 if offload in ("optimizer", "both") else w  # offload: fp32 grads on the host
        out.update(params=w * flat, grads=grad_bytes * part, master_params=4 * part,
                   optimizer_state=state_per_elem * part)
    elif strategy == "zero3":
        part = sum(math.ceil(n / nd) for n in numels)
        # a persistent parameter stays whole next to its partition; on one rank DeepSpeed's "gather"
        # makes the parameter a view of that partition instead (NoGatherHandle), so nothing is extra
        persistent = sum(n for n in numels if n <= persistence_threshold) if nd > 1 else 0
        grads = w * part
        if offload in ("optimizer", "both"):
            grads += 4 * part  # fp32 gradient partition on the host, next to the bit16 buffer
        out.update(params=w * (part + persistent), grads=grads, master_params=4 * part,
                   optimizer_state=state_per_elem * part)
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    if optimizer == "adam":
        out["other"] = 4  # one flat fp32 partition per param group -> one step counter
    return out


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
