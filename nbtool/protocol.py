"""The messages engines publish to the kernel while a cell runs (pure; both sides import it).

Engines publish dicts with ipyparallel's ``publish_data``; each entry's key
says what it carries, and later entries never overwrite earlier ones because
every key is unique. This module is the only place that builds or reads keys.
"""
from __future__ import annotations

import time

RECORDS = "nbtool:"               # a batch of metric records: nbtool:{rank}:{batch}
HANG = "nbtool-hang:"             # a watchdog hang report: nbtool-hang:{rank}:{seq}
STACK = "nbtool-stack:"           # a rank's stack on SIGUSR1: nbtool-stack:{rank}:{time}
COMMBENCH = "nbtool-commbench:"   # one %commbench row: nbtool-commbench:{op}:{count}
KINDS = {RECORDS: "records", HANG: "hang", STACK: "stack", COMMBENCH: "commbench"}


def records_key(rank: int, batch: int) -> str:
    return f"{RECORDS}{rank}:{batch}"


def hang_key(rank: int, seq: int) -> str:
    return f"{HANG}{rank}:{seq}"


def stack_key(rank: int) -> str:
    return f"{STACK}{rank}:{time.time()}"


def commbench_key(op: str, count: int) -> str:
    return f"{COMMBENCH}{op}:{count}"


def kind(key: str) -> str | None:
    """"records", "hang", "stack" or "commbench" for a key this module made; None for any other."""
    for prefix, name in KINDS.items():
        if key.startswith(prefix):
            return name
    return None


def entries(future, want: str):
    """(key, value) of ``future``'s published data that are of kind ``want``."""
    data = future.output.metadata.get("data") or {}
    return [(k, v) for k, v in list(data.items()) if kind(k) == want]
