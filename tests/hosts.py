"""Two "hosts" on this machine: network namespaces joined by a veth pair, each with its own sshd.

Only addresses assigned here (10.213.x.1 and .2 inside namespaces created
here) are ever contacted. Both ends of the veth pair are named ``nbt0``, as a
real cluster's hosts share an interface name. Everything is torn down by
``close`` (namespaces, the veth pair with them, the sshd processes), also
after a failure; every wait is bounded.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

IFNAME = "nbt0"
SSH_PORT = 2222


def unavailable() -> str | None:
    """Why this machine cannot build the two hosts (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "ss", "ssh", "scp", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (.ci/setup installs openssh and iproute2 as root)"
    if not Path("/usr/sbin/sshd").exists():
        return "sshd is not installed (.ci/setup installs openssh-server as root)"
    probe = f"nbtprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if r.returncode:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=10)
    return None


def _run(*cmd, check=True, timeout=20):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=check)


class TwoHosts:
    """Namespaces ``a`` and ``b`` at 10.213.N.1 and .2 on ``nbt0``, sshd on port 2222 in each."""

    def __init__(self, root: Path):
        tag = os.getpid() % 200 + 20
        self.root = root
        self.names = (f"nbtA{os.getpid()}", f"nbtB{os.getpid()}")
        self.addresses = (f"10.213.{tag}.1", f"10.213.{tag}.2")
        self.sshd: list[subprocess.Popen] = []
        self.ssh_config = root / "ssh_config"
        self.shared = root / "shared"  # a directory both "hosts" see (one filesystem)
        self.shared.mkdir()
        self.private = root / "private"  # the second host mounts its own tmpfs here: not shared
        self.private.mkdir()

    def open(self) -> "TwoHosts":
        a, b = self.names
        for ns in self.names:
            _run("ip", "netns", "add", ns)
        va, vb = f"nbv{os.getpid()}a"[-15:], f"nbv{os.getpid()}b"[-15:]
        _run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, end, addr in ((a, va, self.addresses[0]), (b, vb, self.addresses[1])):
            _run("ip", "link", "set", end, "netns", ns)
            _run("ip", "-n", ns, "link", "set", end, "name", IFNAME)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
        key, host_key = self.root / "id", self.root / "host_key"
        for k in (key, host_key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k))
        (self.root / "authorized_keys").write_text((self.root / "id.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
            conf = self.root / f"sshd_{i}"
            conf.write_text("\n".join([
                f"Port {SSH_PORT}", f"ListenAddress {addr}", f"HostKey {host_key}",
                f"AuthorizedKeysFile {self.root / 'authorized_keys'}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "StrictModes no", "UsePAM no",
                f"PidFile {self.root / f'sshd_{i}.pid'}", "Subsystem sftp internal-sftp", ""]))
            sshd = ["/usr/sbin/sshd", "-D", "-e", "-f", str(conf)]
            if i == 1:  # its own mount namespace, where `private` is a tmpfs nobody else sees
                sshd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                        f"mount -t tmpfs nbtool-private {self.private} && exec {' '.join(sshd)}"]
            self.sshd.append(subprocess.Popen(["ip", "netns", "exec", ns, *sshd], stdout=subprocess.DEVNULL,
                                              stderr=open(self.root / f"sshd_{i}.log", "w")))
        self.ssh_config.write_text("\n".join([
            "Host *", f"  Port {SSH_PORT}", f"  IdentityFile {key}", "  StrictHostKeyChecking no",
            "  UserKnownHostsFile /dev/null", "  BatchMode yes", "  LogLevel ERROR", "  ConnectTimeout 5", ""]))
        deadline = time.monotonic() + 20
        for addr in self.addresses:  # both sshd answer before anything uses them
            while True:
                r = self.in_ns(0, "ssh", "-F", str(self.ssh_config), addr, "true", check=False, timeout=10)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd at {addr} did not answer: {r.stderr.strip()}")
                time.sleep(0.2)
        return self

    def in_ns(self, i: int, *cmd, check=True, timeout=20):
        return _run("ip", "netns", "exec", self.names[i], *cmd, check=check, timeout=timeout)

    def listening(self, i: int) -> list[tuple[str, str]]:
        """(local address:port, process) of every TCP listener in namespace i (ss -ltnp)."""
        out = self.in_ns(i, "ss", "-ltnpH").stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 4:
                rows.append((parts[3], " ".join(parts[5:])))
        return rows

    def pids(self, i: int) -> set[int]:
        out = _run("ip", "netns", "pids", self.names[i], check=False).stdout
        return {int(p) for p in out.split()}

    def close(self) -> None:
        for p in self.sshd:
            p.terminate()
        for p in self.sshd:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        for i in range(2):  # anything still in a namespace (a leaked engine) goes with it
            for pid in self.pids(i):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        for ns in self.names:
            _run("ip", "netns", "delete", ns, check=False)
