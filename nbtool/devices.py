"""How many GPUs the kernel's machine offers, found without initialising CUDA."""
from __future__ import annotations

import glob
import os
import re
import sys


def visible_gpu_count() -> int:
    """GPUs visible to this process, numbered 0..count-1 as torch would.

    Uses torch when the kernel already imported it (exact); otherwise counts
    the NVIDIA device nodes, narrowed by CUDA_VISIBLE_DEVICES (cheap:
    importing torch in the kernel would add about a second to every
    ``%cluster start``). Engines re-check with torch before using a GPU.
    """
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    nodes = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    limit = os.environ.get("CUDA_VISIBLE_DEVICES")
    if limit is None:
        return len(nodes)
    entries = [e for e in limit.split(",") if e.strip()]
    return min(len(entries), len(nodes))


def physical_visible_devices(gpus: list[int]) -> str:
    """CUDA_VISIBLE_DEVICES for engines that should see logical GPUs ``gpus``.

    Logical ids are the kernel's (0..count-1); if the kernel itself runs under
    CUDA_VISIBLE_DEVICES, translate through it so engines see the same cards.
    """
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:
        entries = [e.strip() for e in inherited.split(",") if e.strip()]
        return ",".join(entries[g] for g in gpus)
    return ",".join(str(g) for g in gpus)
