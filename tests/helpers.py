"""Small helpers for driving a real InteractiveShell in tests."""
from __future__ import annotations

import psutil


def run(ip, capsys, cell: str):
    """Run ``cell`` through the shell; return (result, stdout, stderr)."""
    capsys.readouterr()
    result = ip.run_cell(cell)
    out, err = capsys.readouterr()
    return result, out, err


def alive(pids) -> list[int]:
    """The pids that still name a live (non-zombie) process."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out
