"""Where a checkpoint's files are and which one is complete (pure Python, kernel and ranks).

See nbtool.rank.checkpoint for what is written; this module only reads the
``latest`` pointer and ``meta.json``, so the kernel can check a path
without importing torch.
"""
from __future__ import annotations

import json
import os
import uuid

FORMAT = 1


class CheckpointError(RuntimeError):
    pass


def latest_dir(path: str) -> str | None:
    """The complete checkpoint under ``path`` (None if there is none)."""
    try:
        with open(os.path.join(path, "latest")) as f:
            name = json.load(f)["dir"]
    except (OSError, ValueError, KeyError):
        return None
    full = os.path.join(path, name)
    return full if os.path.exists(os.path.join(full, "meta.json")) else None


def read_meta(path: str) -> dict:
    d = latest_dir(path)
    if d is None:
        raise CheckpointError(f"no complete checkpoint in {path!r} (expected {os.path.join(path, 'latest')})")
    with open(os.path.join(d, "meta.json")) as f:
        return json.load(f)


def atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
