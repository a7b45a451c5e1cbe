"""Pure option parsing and layout checks (no processes)."""
import pytest
from IPython.core.error import UsageError

from nbtool.options import ClusterOptions, format_ranks, parse_int_list, parse_ranks, resolve_layout


@pytest.mark.parametrize("text,expected", [("0", [0]), ("0,2-3", [0, 2, 3]), (" 1 - 2 ", [1, 2]), ("3,0", [0, 3])])
def test_parse_int_list(text, expected):
    assert parse_int_list(text, "--ranks") == expected


@pytest.mark.parametrize("text,fragment", [
    ("a", "'a' is not a number or range"),
    ("3-1", "range 3-1 is backwards"),
    ("0,0", "names a number twice"),
    ("1,", "'' is not a number or range"),
])
def test_parse_int_list_errors(text, fragment):
    with pytest.raises(UsageError, match=fragment):
        parse_int_list(text, "--ranks")


def test_parse_ranks_checks_world_size():
    assert parse_ranks(None, 3) == [0, 1, 2]
    with pytest.raises(UsageError, match="rank 4 does not exist; this cluster has ranks 0-2"):
        parse_ranks("1,4", 3)


def test_format_ranks():
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_ranks([]) == ""


@pytest.mark.parametrize("opts,gpus,backend,devices", [
    (ClusterOptions(n=2), 0, "gloo", None),
    (ClusterOptions(n=2), 4, "nccl", (0, 1)),
    (ClusterOptions(n=2, backend="gloo"), 4, "gloo", None),
    (ClusterOptions(n=2, gpus=(2, 3)), 4, "nccl", (2, 3)),
    (ClusterOptions(n=2, backend="gloo", gpus=(0, 1)), 2, "gloo", (0, 1)),
])
def test_resolve_layout(opts, gpus, backend, devices):
    layout = resolve_layout(opts, gpus)
    assert (layout.backend, layout.gpus) == (backend, devices)


@pytest.mark.parametrize("opts,gpus,fragment", [
    (ClusterOptions(n=0), 0, "-n 0: a cluster needs at least 1 rank"),
    (ClusterOptions(n=3, gpus=(0, 1)), 4, r"-n 3 needs one GPU per rank but --gpus gives 2 \(0-1\)"),
    (ClusterOptions(n=1, gpus=(5,)), 2, "GPU 5 does not exist; this machine has GPUs 0-1"),
    (ClusterOptions(n=2, backend="nccl"), 0, "--backend nccl needs GPUs and none are visible"),
    (ClusterOptions(n=4), 2, "-n 4 with nccl needs one GPU per rank but 2 GPU"),
    (ClusterOptions(n=2, backend="mpi"), 0, "--backend 'mpi' is not known"),
])
def test_resolve_layout_refusals(opts, gpus, fragment):
    with pytest.raises(UsageError, match=fragment):
        resolve_layout(opts, gpus)
