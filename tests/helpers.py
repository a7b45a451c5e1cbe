"""Small helpers for driving a real InteractiveShell in tests."""
from __future__ import annotations

import os

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


BROWSER_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def orphan_controllers() -> list[int]:
    """ipyparallel controller processes of this test session (its IPYTHONDIR) that neither this
    process nor another such controller holds: what a stopped cluster left behind."""
    mine = os.environ["IPYTHONDIR"]
    ours = {}
    for p in psutil.process_iter(["cmdline", "ppid"]):
        try:
            if "ipyparallel.controller" in " ".join(p.info["cmdline"] or ()) and \
                    p.environ().get("IPYTHONDIR") == mine and p.status() != psutil.STATUS_ZOMBIE:
                ours[p.pid] = p.info["ppid"]
        except psutil.Error:
            continue
    return [pid for pid, parent in ours.items() if parent != os.getpid() and parent not in ours]


def browser_dom(path, budget_ms: int = 8000) -> str:
    """The DOM of a local page after its scripts ran, from headless Chromium."""
    import shutil
    import subprocess
    import tempfile

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "Chromium is needed for browser tests: apt-get install chromium (.ci/setup does this as root)"
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [exe, *BROWSER_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
             "--dump-dom", f"file://{path}"],
            capture_output=True, text=True, timeout=120,
        )
    return out.stdout


def site(cls, unavailable, what: str, root):
    """A fixture's body for a real site the tests build (two hosts, a Slurm): skipped with the reason
    where this machine cannot build it; ``cls(root).open()`` yielded, ``close()`` even after a failure."""
    import pytest

    why = unavailable()
    if why:
        pytest.skip(f"{what}: {why}")
    made = cls(root)
    try:
        yield made.open()
    finally:
        made.close()
