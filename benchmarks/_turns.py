"""Two multi-rank jobs on one machine taking turns step by step (strategy_overhead.py's pairing).

Each rank of each job holds a named pipe; a rank blocks reading its pipe until
it is given the turn (no polling, so a waiting job costs nothing). After its
step a job's ranks meet at a barrier, then its rank 0 writes one byte to each
rank's pipe of the other job. So every step of one job is timed between two
steps of the other, a fraction of a second apart, and drift of the machine
over seconds hits both alike.

    with Pipes(folder, {"a": 2, "b": 2}) as pipes:   # the coordinator, for the whole exchange
        pipes.give("a")                              # a's first turn
        ...                                          # start both jobs, wait for their ends
    turns = Turns(folder, "a", "b", 2, rank)         # on each rank of job a
    turns.wait(); <step>; turns.give()
"""
from __future__ import annotations

import os
import select
from pathlib import Path


def _pipe(folder, job: str, rank: int) -> Path:
    return Path(folder) / f"{job}.{rank}"


class Pipes:
    """The coordinator's pipes: created, and held open so a byte written before its reader opens is kept."""

    def __init__(self, folder, jobs: dict[str, int]):
        self.folder, self.jobs, self.fds = folder, jobs, []
        for job, n in jobs.items():
            for r in range(n):
                os.mkfifo(_pipe(folder, job, r))
                self.fds.append(os.open(_pipe(folder, job, r), os.O_RDWR))

    def give(self, job: str) -> None:
        give(self.folder, job, self.jobs[job])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self.fds:
            os.close(fd)
        for job, n in self.jobs.items():
            for r in range(n):
                _pipe(self.folder, job, r).unlink()


def give(folder, job: str, ranks: int) -> None:
    """Give ``job`` the turn: a byte to each of its ranks' pipes."""
    for r in range(ranks):
        fd = os.open(_pipe(folder, job, r), os.O_RDWR)  # O_RDWR: a FIFO's open then never blocks
        try:
            os.write(fd, b"t")
        finally:
            os.close(fd)


class Turns:
    """One rank's side; ``Turns(folder, me, other, other_ranks, rank)``, the first four as the job was told."""

    def __init__(self, folder, me: str, other: str, other_ranks: int, rank: int, timeout_s: float = 300.0):
        self.folder, self.other, self.rank, self.other_ranks = folder, other, rank, other_ranks
        self.fd = os.open(_pipe(folder, me, rank), os.O_RDWR)
        self.timeout_s = timeout_s

    def wait(self) -> None:
        """Block until given the turn; a job that stopped taking turns is an error, not a hang."""
        if not select.select([self.fd], [], [], self.timeout_s)[0]:
            raise TimeoutError(f"no turn given in {self.timeout_s:.0f} s (the other job stopped?)")
        os.read(self.fd, 1)

    def give(self) -> None:
        import torch.distributed as dist

        dist.barrier()  # every rank of this job is done with its step before the other starts
        if self.rank == 0:
            give(self.folder, self.other, self.other_ranks)

    def close(self) -> None:
        os.close(self.fd)
