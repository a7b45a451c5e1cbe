"""The NCCL flight recorder's entries merged into nbtool's hang report (nbtool.flight_recorder).

The dumps are shaped as torch's ``_dump_nccl_trace`` pickles them (a dict with
"entries", each with process_group, collective_seq_id, profiling_name,
input_sizes, state, duration_ms); they stand in for the NCCL runtime only.
"""
from __future__ import annotations

from nbtool.faults import HangReport
from nbtool.flight_recorder import enable, entries, merge


def entry(seq, state, op="nccl:all_reduce", pg=("0", "default_pg"), sizes=((1024,),)):
    return {"record_id": seq, "pg_id": 0, "process_group": pg, "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": op, "time_created_ns": 1000 * seq, "input_sizes": [list(s) for s in sizes],
            "output_sizes": [list(s) for s in sizes], "state": state, "duration_ms": 1.5 if state == "completed"
            else None, "frames": []}


def dumps():
    # rank 0 and 1 completed #1-#3 and entered #4; rank 2 completed #1-#3 and never issued #4;
    # rank 3 is still in #3 (started)
    done = [entry(s, "completed") for s in (1, 2, 3)]
    return {0: entries({"entries": done + [entry(4, "started")]}),
            1: entries({"entries": done + [entry(4, "scheduled")]}),
            2: entries({"entries": done}),
            3: entries({"entries": done[:2] + [entry(3, "started")]})}


def test_entries_keep_plain_fields():
    (e,) = entries({"entries": [entry(7, "started", op="nccl:_allgather_base", sizes=((4, 256),))]})
    assert e == {"pg": "0", "seq": 7, "p2p_seq": 0, "op": "_allgather_base", "state": "started",
                 "sizes": [[4, 256]], "duration_ms": None}
    assert len(entries({"entries": [entry(s, "completed") for s in range(1, 100)]})) == 32  # the newest only


def test_merge_says_who_completed_started_or_never_arrived():
    lines = merge(dumps(), 4)
    assert lines == [
        "pg 0 collective #3 all_reduce [[1024]]: completed on rank(s) 0, 1, 2; started on rank(s) 3",
        "pg 0 collective #4 all_reduce [[1024]]: started on rank(s) 0; scheduled on rank(s) 1; "
        "never arrived on rank(s) 2, 3",
    ]
    partial = dumps()
    del partial[3]
    assert merge(partial, 4)[-1] == "no recorder answer from rank(s) 3"
    assert merge({0: None, 1: None}, 2) == []  # gloo ranks: no recorder, nothing added


def test_hang_report_prints_the_recorder_section():
    blocked = {"seq": 4, "op": "all_reduce", "size_bytes": 4096, "group_size": 4, "dtype": "float32",
               "age_s": 61.0, "issued": 4, "stack": []}
    rep = HangReport(blocked={0: blocked}, others={2: ("running Python, not in a collective; 3 collective(s) issued",
                                                       [])}, issued={2: 3}, timeout_s=60, flight=dumps(), world_size=4)
    text = rep.text()
    assert "NCCL flight recorder (collectives not completed everywhere, newest last):" in text
    assert "    pg 0 collective #4 all_reduce [[1024]]: started on rank(s) 0; scheduled on rank(s) 1; " \
           "never arrived on rank(s) 2, 3" in text
    assert "NCCL flight recorder" not in HangReport(blocked={0: blocked}, timeout_s=60).text()


def test_enable_sets_the_recorder_on_and_keeps_user_settings():
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    enable(env)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_ENABLE_TIMING": "1"}
