"""PyTorch's NCCL flight recorder in nbtool's hang reports.

On nccl ranks bootstrap turns the recorder on (``TORCH_NCCL_TRACE_BUFFER_SIZE``
entries, ``TORCH_NCCL_ENABLE_TIMING`` for durations) before the process group
exists. When the watchdog reports a hang, each rank adds ``read()``: its
recorder's recent entries (from ``torch._C._distributed_c10d._dump_nccl_trace``),
reduced to plain fields. The kernel merges them with ``merge``: for each
collective (process group, sequence number), which ranks completed it,
which started or only scheduled it, and which never arrived, as
``torchfrtrace`` prints after the fact, but live while the cell still runs.
gloo has no such recorder; its hang report stays as it is.
"""
from __future__ import annotations

BUFFER_ENTRIES = 2000
KEEP = 32  # the newest entries per rank that go into a report


def enable(environ) -> None:
    """Turn the recorder on for process groups created after this (user settings win)."""
    environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(BUFFER_ENTRIES))
    environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")


def entries(dump: dict, keep: int = KEEP) -> list[dict]:
    """The newest collective entries of one rank's recorder dump, as plain fields."""
    out = []
    for e in dump.get("entries", [])[-keep:]:
        pg = e.get("process_group") or (e.get("pg_id"), "")
        name = str(e.get("profiling_name", ""))
        out.append({"pg": str(pg[0] if isinstance(pg, (tuple, list)) else pg),
                    "seq": int(e.get("collective_seq_id", 0) or 0),
                    "p2p_seq": int(e.get("p2p_seq_id", 0) or 0),
                    "op": name.split(":", 1)[-1] or "?", "state": str(e.get("state", "?")),
                    "sizes": [list(s) for s in e.get("input_sizes", [])][:2],
                    "duration_ms": e.get("duration_ms")})
    return out


def read() -> list[dict] | None:
    """This rank's recent entries, or None where there is no NCCL recorder (gloo, CPU)."""
    import pickle

    try:
        import torch

        if not torch.cuda.is_available():
            return None
        raw = torch._C._distributed_c10d._dump_nccl_trace()
    except Exception:
        return None
    try:
        return entries(pickle.loads(raw))
    except Exception:
        return None


_ORDER = {"completed": 3, "started": 2, "scheduled": 1}


def merge(per_rank: dict[int, list[dict]], world_size: int, limit: int = 6) -> list[str]:
    """Report lines: the last collectives not completed on every rank, each with every rank's state."""
    seen: dict = {}
    for rank, items in per_rank.items():
        for e in items or []:
            if e["seq"] == 0:  # point-to-point entries have no collective sequence number
                continue
            key = (e["pg"], e["seq"])
            seen.setdefault(key, {"op": e["op"], "sizes": e["sizes"], "ranks": {}})["ranks"][rank] = e["state"]
    reporting = sorted(r for r, items in per_rank.items() if items is not None)
    lines = []
    open_keys = [k for k, v in sorted(seen.items())
                 if any(v["ranks"].get(r) != "completed" for r in reporting)]
    for key in open_keys[-limit:]:
        v = seen[key]
        states: dict = {}
        for r in reporting:
            states.setdefault(v["ranks"].get(r, "never arrived"), []).append(r)
        parts = sorted(states.items(), key=lambda kv: -_ORDER.get(kv[0], 0))
        lines.append(f"pg {key[0]} collective #{key[1]} {v['op']} {v['sizes'] or ''}".rstrip() + ": "
                     + "; ".join(f"{state} on rank(s) {', '.join(map(str, rs))}" for state, rs in parts))
    silent = sorted(set(range(world_size)) - set(reporting))
    if lines and silent:
        lines.append(f"no recorder answer from rank(s) {', '.join(map(str, silent))}")
    return lines
