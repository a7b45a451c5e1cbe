"""A cluster no one else can drive, and magic lines that cannot do harm.

Real processes: the listening sockets of the controller, engines and nannies
are read from the OS; a client with the wrong key tries to run code on the
engines; a few hundred random and mutated lines go through every magic.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import random
import stat

import ipyparallel as ipp
import psutil
import pytest
from helpers import run
from IPython.core.error import UsageError


def _cluster_processes() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def test_nothing_listens_beyond_loopback(ip, cluster):
    listening = []
    for proc in _cluster_processes():
        try:
            listening += [(proc.pid, c.laddr.ip) for c in proc.net_connections(kind="inet") if c.status == "LISTEN"]
        except psutil.Error:
            continue
    assert listening, "expected the controller's sockets"
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::1"}, listening


def test_connection_files_and_rendezvous_are_owner_only(ip, cluster):
    rc = cluster
    security = pathlib.Path(rc._cluster.profile_dir) / "security"
    files = list(security.glob(f"ipcontroller-{rc._cluster.cluster_id}-*.json"))
    assert {f.name.rsplit("-", 1)[1] for f in files} == {"client.json", "engine.json"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert json.loads(f.read_text())["key"]  # messages are signed with this per-cluster key
    assert stat.S_IMODE(os.stat(rc._store_dir).st_mode) == 0o700


def _client_file(rc, tmp_path, key: str | None) -> str:
    src = pathlib.Path(rc._cluster.profile_dir) / "security" / f"ipcontroller-{rc._cluster.cluster_id}-client.json"
    info = json.loads(src.read_text())
    if key is not None:
        info["key"] = key
    out = tmp_path / f"client-{key or 'right'}.json"
    out.write_text(json.dumps(info))
    return str(out)


def _try_to_run(url_file: str, marker: pathlib.Path) -> None:
    try:
        client = ipp.Client(url_file, timeout=3)
    except Exception:
        return
    try:
        client[:].execute(f"open({str(marker)!r}, 'w').write('ran')").wait(5)
    except Exception:
        pass
    finally:
        client.close()


def test_a_client_without_the_key_cannot_run_code(ip, cluster, tmp_path):
    rc = cluster
    marker = tmp_path / "ran-with-wrong-key"
    _try_to_run(_client_file(rc, tmp_path, "0" * 32), marker)
    assert not marker.exists()
    # the same client with the right key does run code: the check above could fail
    control = tmp_path / "ran-with-right-key"
    _try_to_run(_client_file(rc, tmp_path, None), control)
    assert control.read_text() == "ran"


def test_nbtool_never_evaluates_magic_line_text():
    """No eval/exec/compile of strings in nbtool's kernel-side code (the cell body goes to the ranks as is)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    offenders = []
    for path in [*(root / "nbtool").rglob("*.py"), *(root / "widgets").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("eval", "exec", "compile"):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


# -- fuzzing the magic lines ------------------------------------------------------------

VALID = {
    ("line", "cluster"): ["status", "start -n 2", "start --backend gloo --timeout 30 --collective-timeout 5"],
    ("cell", "distributed"): ["", "--ranks 0", "--timeout 30 --quiet", "ddp --bucket-mb 1", "fsdp --wrap Block",
                              "zero3 --offload both --micro-batch 4", "zero2 --overlap-comm --precision bf16",
                              "ddp --grad-accum 2 --seed 3 --name run", "fsdp --checkpoint-every 2 --checkpoint-dir ck",
                              "compare ddp, fsdp --precision bf16", "--collective-timeout 9"],
    ("cell", "rank"): ["0", "1 --timeout 20", "0-1 --quiet"],
    ("line", "dist_push"): ["fuzz_value", "fuzz_value --ranks 1"],
    ("line", "dist_pull"): ["fuzz_rank_value", "fuzz_rank_value --rank 0"],
    ("line", "commbench"): ["all_reduce", "all_gather reduce_scatter --dtype bfloat16", "broadcast --ranks 0,1"],
    ("line", "dist_plan"): ["--model 7e9 --devices 8", "--model gpt2 --precision fp32 --checkpointing full",
                            "--vs ddp --calibrate-on ddp --deterministic", "--text --model 1e8 --calibrate-on ddp"],
    ("line", "dist_compare"): ["", "ddp --deterministic", "ddp --calibrate-on ddp"],
    ("line", "dist_metrics"): ["export out.json", "export out.csv --name ddp", "load out.json --name again"],
    ("line", "dist_checkpoint"): ["save ck", "load ck --no-optimizer"],
}
JUNK = ["-1", "0", "abc", "1e99", "nan", "inf", "''", '"', "--", "-", "=", ",", "0-", "9-0", "../../x",
        "__import__('os').system('touch PWNED')", "$(touch PWNED)", "`touch PWNED`", "{x}", "%x", "\\",
        "zero4", "ddp,", "--ranks", "--sizes", "1KB:1B", "--precision", "fp8", "-n", "99", "0,0", "🙂"]
# accepted lines must stay cheap on the ranks
SUFFIX = {"commbench": " --sizes 4B --iters 1 --warmup 0"}


def _mutate(rng: random.Random, line: str) -> str:
    tokens = line.split()
    for _ in range(rng.randint(1, 3)):
        choice = rng.random()
        if choice < 0.3 and tokens:
            tokens.pop(rng.randrange(len(tokens)))
        elif choice < 0.6 and tokens:
            tokens[rng.randrange(len(tokens))] = rng.choice(JUNK)
        elif choice < 0.8:
            tokens.insert(rng.randint(0, len(tokens)), rng.choice(JUNK))
        elif len(tokens) > 1:
            i, j = rng.sample(range(len(tokens)), 2)
            tokens[i], tokens[j] = tokens[j], tokens[i]
    return " ".join(tokens)


def _lines(seed: int = 1234, per_line: int = 12) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    out = []
    for (kind, magic), lines in VALID.items():
        for line in lines:
            out.append((kind, magic, line))
            out += [(kind, magic, _mutate(rng, line)) for _ in range(per_line)]
        out += [(kind, magic, " ".join(rng.choice(JUNK) for _ in range(rng.randint(1, 4)))) for _ in range(5)]
    return out


def test_fuzzed_magic_lines_are_accepted_or_usage_errors(ip, cluster, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = _lines()
    assert len(lines) >= 300
    ip.user_ns["fuzz_value"] = 41
    run(ip, capsys, "%%distributed\nfuzz_rank_value = rank\nkept = 'yes'")
    outcomes = {"ok": 0, "usage": 0}
    bad = []
    for kind, magic, line in lines:
        first = line.split()[:1]
        if magic == "cluster" and first and first[0] in ("stop", "restart"):
            continue  # valid lines that would end the session's cluster
        line = line + SUFFIX.get(magic, "")
        try:
            if kind == "line":
                ip.run_line_magic(magic, line)
            else:
                ip.run_cell_magic(magic, line, "pass")
            outcomes["ok"] += 1
        except UsageError as e:
            outcomes["usage"] += 1
            if "\n" in str(e).strip() or len(str(e)) > 400:
                bad.append((magic, line, f"long UsageError: {e}"))
        except BaseException as e:  # noqa: BLE001 - anything else is the bug this test looks for
            bad.append((magic, line, f"{type(e).__name__}: {e}"))
    capsys.readouterr()
    assert bad == [], bad[:5]
    assert outcomes["ok"] > 30 and outcomes["usage"] > 150, outcomes
    assert not list(tmp_path.rglob("PWNED")) and not pathlib.Path("PWNED").exists()
    # nothing wedged, nothing lost
    res, out, _ = run(ip, capsys, "%%distributed\nt = torch.ones(1); dist.all_reduce(t); print(kept, t.item())")
    assert res.success and "[rank 1] yes 2.0" in out


@pytest.mark.parametrize("line", ["start -n 2 --timeout=$(touch PWNED)", "status; import os"])
def test_shell_like_text_is_just_a_bad_value(ip, cluster, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError):
        ip.run_line_magic("cluster", line)
    assert not (tmp_path / "PWNED").exists()
