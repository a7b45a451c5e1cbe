"""A real Slurm on this machine for the tests: munged, slurmctld and slurmd from Debian's packages,
configured in a temporary directory (one node, this host, 2 CPUs), on free loopback ports; the
default partition ``debug``, and ``urgent``, whose jobs preempt (cancel) debug's.

``SlurmSite(dir).open()`` starts them and sets SLURM_CONF so sbatch, squeue and
scancel (and ipyparallel's launcher, which calls them) use this site;
``close()`` stops the daemons, cancels what is left and restores the
environment, also after a failure. Every wait is bounded.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol")


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "slurmd runs as root here (its node's jobs run as the submitting user)"
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    return f"{', '.join(missing)} not installed (.ci/setup installs slurm-wlm and munge as root)" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmSite:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self._old_conf = os.environ.get("SLURM_CONF")
        self.pids: list[int] = []

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.root / f"{name}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def open(self) -> "SlurmSite":
        r = self.root
        for d in ("state", "spool"):
            (r / d).mkdir()
        key = r / "munge.key"
        subprocess.run(["mungekey", "-c", "-f", "-k", str(key)], check=True, capture_output=True, timeout=30)
        key.chmod(0o400)
        subprocess.run(["munged", f"--key-file={key}", f"--socket={r / 'munge.sock'}", f"--pid-file={r / 'munged.pid'}",
                        f"--log-file={r / 'munged.log'}", f"--seed-file={r / 'munge.seed'}", "--force"],
                       check=True, capture_output=True, timeout=30)
        host = socket.gethostname()
        self.conf.write_text("\n".join([
            "ClusterName=nbtool", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}", "AuthType=auth/munge", f"AuthInfo=socket={r / 'munge.sock'}",
            "CredType=cred/munge", f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none", "SlurmUser=root",
            "SlurmdUser=root", "SchedulerType=sched/builtin", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MinJobAge=300", "KillWait=5",
            # a higher-tier partition whose jobs preempt (cancel) the default partition's
            "PreemptType=preempt/partition_prio", "PreemptMode=CANCEL",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4 "
            "PriorityTier=1",
            f"PartitionName=urgent Nodes={host} MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=10", ""]))
        os.environ["SLURM_CONF"] = str(self.conf)
        subprocess.run(["slurmctld", "-c"], check=True, capture_output=True, timeout=30)
        subprocess.run(["slurmd"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 30
        while True:  # the node idle: jobs can start
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout
            if out.strip() == "idle":
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurm did not come up (sinfo: {out.strip()!r}); see {r}/slurmctld.log")
            time.sleep(0.3)

    def jobs(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=10).stdout
        return [line for line in out.splitlines() if line.strip()]

    def close(self) -> None:
        subprocess.run(["scancel", "--user", "root"], capture_output=True, timeout=10)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._pid(name)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    continue
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        os.kill(pid, 0)
                    except OSError:
                        break
                    time.sleep(0.1)
                else:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        if self._old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_conf
