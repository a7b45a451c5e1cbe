"""What went wrong on the ranks, told plainly: dead engines, hangs, consequential errors.

Kernel side. ``execution.run_cell`` feeds this module what the ranks report
and uses ``release`` to get blocked ranks out of a collective; nothing here
draws widgets.
"""
from __future__ import annotations

import contextlib
import re
import sys
import time
from dataclasses import dataclass, field

from . import protocol
from .metrics import format_bytes
from .options import label_ranks

# errors a rank raises *because* another rank failed or was interrupted: shown after the cause
_CONSEQUENTIAL = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Socket Timeout|Timed out waiting|"
    r"process group has been destroyed|NCCL communicator was aborted|has not been initialized"
)

# frames of the machinery between the engine and the user's code: left out of stacks
_PLUMBING = ("/IPython/", "/ipykernel/", "/ipyparallel/", "/zmq/", "/tornado/", "/asyncio/", "/traitlets/",
             "threading.py", "runpy", "<frozen ", "/nbtool/rank/", "c10d_logger.py")


@dataclass
class RankFailure:
    """An error-like record for a rank whose engine died (RankError shows it like a remote error)."""

    ename: str
    evalue: str
    traceback: str = ""


def is_consequential(err) -> bool:
    name = getattr(err, "ename", type(err).__name__)
    value = str(getattr(err, "evalue", err))
    return name == "KeyboardInterrupt" or bool(_CONSEQUENTIAL.search(value))


def is_engine_death(err) -> bool:
    return "EngineError" in str(getattr(err, "ename", "")) or "died while running task" in str(
        getattr(err, "evalue", ""))


def last_lines(text, n: int = 3) -> str:
    text = text.block() if hasattr(text, "block") else str(text)
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) if lines else "(no output)"


def death_record(cluster, rank: int, output: str) -> RankFailure:
    log = cluster.log_file(rank)
    value = (f"rank {rank}{cluster.where(rank)} died during the cell: {cluster.exit_reason(rank)}; its last output: "
             f"{last_lines(output)}")
    tb = f"engine log (native errors, faulthandler stacks): {log}" if log else ""
    return RankFailure("RankDied", value, tb)


def user_frames(stack: list[str], keep: int = 6) -> list[str]:
    frames = [f for f in stack if not any(p in f.split("\n", 1)[0] for p in _PLUMBING)]
    return frames[-keep:]


def describe_op(r: dict) -> str:
    extra = f", {r['dtype']}" if r.get("dtype") else ""
    return f"{r['op']} #{r['seq']} ({format_bytes(r['size_bytes'])}{extra}, group of {r['group_size']})"


@dataclass
class HangReport:
    """What the watchdog found: blocked ranks, and where every other rank was."""

    blocked: dict = field(default_factory=dict)  # rank -> watchdog report
    others: dict = field(default_factory=dict)  # rank -> one-line state, with stack lines
    issued: dict = field(default_factory=dict)  # rank -> collectives it had issued (ranks not blocked)
    timeout_s: float = 0.0
    reported_at: float = 0.0  # time.time() when it was shown
    flight: dict = field(default_factory=dict)  # rank -> NCCL flight recorder entries (nccl ranks only)
    world_size: int = 0

    def summary(self) -> str:
        """The report without times and file paths: who is where, in collective sequence numbers."""
        lines = [f"rank {r}: blocked in {describe_op(self.blocked[r])}" for r in sorted(self.blocked)]
        lines += [f"rank {r}: {state}" for r, (state, _) in sorted(self.others.items())]
        return "\n".join(lines)

    def text(self) -> str:
        first = self.blocked[min(self.blocked)]
        lines = [f"nbtool watchdog: {label_ranks(sorted(self.blocked))} blocked in a collective for more than "
                 f"{self.timeout_s:g}s (--collective-timeout)"]
        for rank in sorted(set(self.blocked) | set(self.others)):
            if rank in self.blocked:
                r = self.blocked[rank]
                lines.append(f"  rank {rank}: in {describe_op(r)} for {r['age_s']:.1f}s; "
                             f"{r['issued']} collective(s) issued so far, at:")
                lines.extend("    " + ln for f in user_frames(r.get("stack", [])) for ln in f.rstrip().splitlines())
            else:
                state, stack = self.others[rank]
                lines.append(f"  rank {rank}: {state}" + (", at:" if stack else ""))
                lines.extend("    " + ln for f in user_frames(stack) for ln in f.rstrip().splitlines())
        behind = [r for r, n in self.issued.items() if r not in self.blocked and n < first["seq"]]
        if behind:
            lines.append(f"  {label_ranks(sorted(behind))} never reached collective #{first['seq']}: "
                         "the ranks disagree on the order of collectives")
        from .flight_recorder import merge

        recorded = merge(self.flight, self.world_size or len(self.blocked) + len(self.others))
        if recorded:
            lines.append("  NCCL flight recorder (collectives not completed everywhere, newest last):")
            lines.extend("    " + ln for ln in recorded)
        lines.append("  way out: interrupt (Ctrl-C / the stop button) stops the ranks; ranks blocked in the "
                     "collective are released by closing the process group (then %cluster restart), "
                     "or wait if a rank is only slow")
        return "\n".join(lines)


class HangWatch:
    """Collects watchdog reports during a cell and prints one report with every rank's state."""

    STACK_WAIT_S = 1.0  # how long to wait for the stacks of ranks running Python

    def __init__(self, cluster, children):
        self.cluster, self.children = cluster, children

        self.reports: dict[int, dict] = {}
        self.stacks: dict[int, dict] = {}
        self.asked_at: float | None = None
        self.printed: set[int] = set()
        self.last: HangReport | None = None

    def tick(self) -> None:
        for rank, f in self.children:
            for _, value in protocol.entries(f, "hang"):
                if rank not in self.reports:
                    self.reports[rank] = value
            for _, value in protocol.entries(f, "stack"):
                self.stacks[rank] = value
        new = set(self.reports) - self.printed
        if not new:
            return
        running = [r for r, f in self.children if not f.done() and r not in self.reports]
        if self.asked_at is None and running:
            self.asked_at = time.perf_counter()
            with contextlib.suppress(Exception):
                self.cluster.signal(running, "SIGUSR1")  # the watchdog's SIGUSR1 handler publishes its stack
        waiting = [r for r in running if r not in self.stacks]
        if waiting and self.asked_at is not None and time.perf_counter() - self.asked_at < self.STACK_WAIT_S:
            return
        self.last = self._report(running)
        self.last.reported_at = time.time()
        self.cluster.last_hang = self.last
        print(self.last.text(), file=sys.stderr, flush=True)
        self.printed |= set(self.reports)

    def _report(self, running: list[int]) -> HangReport:
        from .rank import watchdog

        rep = HangReport(blocked=dict(self.reports), timeout_s=self.cluster.collective_timeout,
                         world_size=self.cluster.world_size)
        for rank, value in list(self.reports.items()) + list(self.stacks.items()):
            if value.get("flight") is not None:
                rep.flight[rank] = value["flight"]
        in_cell = {r for r, _ in self.children}
        done = {r for r, f in self.children if f.done()}
        lost = set(self.cluster.lost_ranks())
        for rank in range(self.cluster.world_size):
            if rank in self.reports:
                continue
            if rank in lost:
                rep.others[rank] = ("engine lost", [])
            elif rank in running or (rank in in_cell and rank not in done):
                s = self.stacks.get(rank)
                if s is None:
                    rep.others[rank] = ("running, did not answer a stack request (in native code?)", [])
                else:
                    rep.others[rank] = (f"running Python, not in a collective; {s['issued']} collective(s) issued",
                                        s.get("stack", []))
                    rep.issued[rank] = s["issued"]
            else:
                where = "finished the cell" if rank in in_cell else "not running this cell"
                try:
                    st = self.cluster.view([rank]).apply_async(watchdog.state).get(timeout=2.0)[0]
                    rep.others[rank] = (f"{where}; {st['issued']} collective(s) issued", [])
                    rep.issued[rank] = st["issued"]
                except Exception:
                    rep.others[rank] = (f"{where}; did not answer", [])
        return rep


@dataclass
class Release:
    """What ``release`` did to ranks that had to be stopped."""

    stopped: list[int]  # stopped by SIGINT
    released: list[int]  # released from a collective by closing the process group
    closed_on: list[int]  # ranks whose process group was closed for that
    restarted: bool  # nothing else worked: fresh engines
    stuck: list[int] = field(default_factory=list)  # still running (only when no restart was allowed)
    killed: list[int] = field(default_factory=list)  # engines stopped: blocked with a host that was lost
    lost_hosts: str = ""  # those hosts, for the note

    def note(self) -> str:
        parts = []
        if self.stopped:
            parts.append(f"{label_ranks(self.stopped)} stopped on interrupt")
        if self.released:
            one = len(self.released) == 1
            parts.append(
                f"{label_ranks(self.released)} {'was' if one else 'were'} released by closing the process group "
                f"on {label_ranks(self.closed_on)} ({'it' if one else 'they'} stayed blocked in a collective "
                "after the interrupt); the ranks' variables are still there, but collectives need "
                "%cluster restart")
        if self.restarted:
            parts.append("ranks stayed blocked in native code, so the engines were restarted "
                         "(fresh ranks: variables are gone; resume from a checkpoint)")
        if self.stuck:
            parts.append(f"{label_ranks(self.stuck)} still running (blocked)")
        if self.killed:
            parts.append(f"{label_ranks(self.killed)} stayed blocked in a collective with the lost host's ranks, "
                         f"so {'its engine was' if len(self.killed) == 1 else 'their engines were'} stopped "
                         f"(variables are gone); %cluster restart brings back the layout once {self.lost_hosts} "
                         "can be reached")
        return "; ".join(parts)


INTERRUPT_GRACE_S = 3.0
RELEASE_GRACE_S = 3.0


def release(cluster, children, late: list[int], progress, unresponsive: list[int] = ()) -> Release:
    """Stop ``late`` ranks: SIGINT, then close the process group on idle ranks, then restart.

    ``unresponsive`` ranks (engines that do not answer at all) are neither
    signalled nor used to close the group, and no restart happens for them:
    the user decides (the rank may come back, e.g. when a machine wakes).
    """
    lost = set(cluster.lost_ranks())
    alive_late = [r for r in late if r not in lost]
    futures = dict(children)

    def unfinished():
        return [r for r in late if r in futures and not futures[r].done()]

    def wait(seconds: float):
        deadline = time.perf_counter() + seconds
        while unfinished() and time.perf_counter() < deadline:
            time.sleep(0.05)
        return unfinished()

    if alive_late:
        with contextlib.suppress(Exception):
            cluster.signal(alive_late, "SIGINT")
    stuck = wait(INTERRUPT_GRACE_S)
    stopped = [r for r in late if r not in stuck]
    if not stuck:
        return Release(stopped, [], [], False)
    idle = [r for r in range(cluster.world_size)
            if r not in stuck and r not in lost and r not in unresponsive]
    if idle:
        cluster.close_group(idle, f"closed to release {label_ranks(stuck)} from a blocked collective")
        still = wait(RELEASE_GRACE_S)
        if not still:
            return Release(stopped, stuck, idle, False)
        stuck = still
    if unresponsive:
        return Release(stopped, [], idle, False, stuck=stuck)
    if lost and cluster.options.multi_host:
        # fresh engines need every host, and a lost one may be cut off (a restart would wait out
        # --timeout on it): stop only the blocked engines, through their own hosts' nannies
        hosts = cluster.lost_text()
        progress(f"{label_ranks(stuck)} still blocked with the lost host's ranks: stopping "
                 f"{'its' if len(stuck) == 1 else 'their'} engine(s) ...")
        cluster.signal(stuck, "SIGKILL")
        wait(RELEASE_GRACE_S)
        return Release(stopped, [], idle, False, killed=stuck, lost_hosts=hosts)
    progress(f"{label_ranks(stuck)} still blocked: restarting the engines ...")
    cluster.restart(progress)
    return Release(stopped, [], idle, True)
