"""Ranks of one host taking turns at a memory-hungry phase (nbtool.rank.host_turns), on real processes
meeting through real lock files."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import tempfile
import time
import uuid

from nbtool.rank import host_turns as ht

MIB = 1 << 20


def _one(phase, ranks, cost_mib, hold_s, wait_s, room_mib, guess_mib, out):
    """A rank's turn: hold ``cost_mib`` for ``hold_s``; report (start, end, first, slots, waited)."""
    if room_mib is not None:  # this host's memory as the phase sees it: room for ``room_mib`` beyond the reserve
        import psutil

        total = psutil.virtual_memory().total
        reserve = max(ht.RESERVE_FRACTION * total, ht.RESERVE_MIN)
        ht._available = lambda: (reserve + room_mib * MIB, total)
    guess = None if guess_mib is None else guess_mib * MIB
    with ht.host_turns(phase, ranks, guess, wait_s=wait_s, poll_s=0.02) as turn:
        start = time.monotonic()
        block = bytearray(cost_mib * MIB)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident
        turn.at_height()
        time.sleep(hold_s)
        del block
        end = time.monotonic()
    out.put((start, end, turn.first, turn.slots, turn.waited_s))


def _run(ranks, cost_mib=64, hold_s=0.4, wait_s=30.0, room_mib=None, guess_mib=None, phase=None):
    phase = phase or f"test-{uuid.uuid4().hex}"
    out = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_one, args=(phase, ranks, cost_mib, hold_s, wait_s, room_mib, guess_mib, out))
             for _ in range(ranks)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    return phase, got


def _most_at_once(turns) -> int:
    edges = sorted([(s, 1) for s, *_ in turns] + [(e, -1) for _, e, *_ in turns])
    now = most = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def test_the_first_goes_alone_then_as_many_as_memory_holds():
    """The first rank runs alone and measures its cost (64 MiB); then, each later cost taken as 1.25x
    that, room for 2.2 costs lets one go at a time and room for 3.3 two. The state and lock files are
    gone after the host's last rank."""
    for room, slots in ((2.2, 1), (3.3, 2)):
        phase, turns = _run(4, room_mib=room * 64)
        firsts = [t for t in turns if t[2]]
        assert len(firsts) == 1, turns
        (_, e0, *_), others = firsts[0], [t for t in turns if not t[2]]
        assert all(s >= e0 for s, *_ in others), turns  # nobody ran beside the first
        assert all(t[3] == slots for t in turns), (room, turns)
        assert _most_at_once(others) == slots, (room, turns)
        assert not glob.glob(os.path.join(tempfile.gettempdir(), f"nbtool-turns-{os.getuid()}-{phase}*"))


def test_a_guess_the_host_plainly_holds_lets_every_rank_go_at_once():
    """Room for 6 guesses of 64 MiB (x1.25): 4 ranks go together; a guess of 128 MiB: turns."""
    _, turns = _run(4, room_mib=6 * 64, guess_mib=64)
    assert _most_at_once(turns) == 4 and not any(t[2] for t in turns), turns
    _, turns = _run(4, room_mib=6 * 64, guess_mib=128)
    assert sum(t[2] for t in turns) == 1 and _most_at_once(turns) < 4, turns


def test_a_rank_alone_on_its_host_does_not_wait():
    _, [(start, end, first, slots, waited)] = _run(1)
    assert waited == 0.0 and not first


def test_a_waiting_rank_goes_after_wait_s_when_the_first_never_finishes():
    """A first rank that holds its turn for 3 s: with wait_s 0.5 the others go at about 0.5 s."""
    phase, turns = _run(3, hold_s=3.0, wait_s=0.5)
    others = [t for t in turns if not t[2]]
    assert len(others) == 2 and all(0.5 <= t[4] < 2.5 for t in others), turns
