"""The shape of the code that users never see but every change leans on.

One option table (StrategySpec's fields) drives the magic's arguments, the
spec copy and the "does not apply" checks; engine code imports no display code;
the engine -> kernel message keys live in one protocol module.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from IPython.core.error import UsageError

from nbtool.magics import NbtoolMagics, parse_strategy_line
from nbtool.spec import GROUPS, OPTION_FIELDS, StrategySpec, flag_of

ROOT = Path(__file__).resolve().parents[1]

# a strategy that takes the option, the text after the flag, and the value the spec must hold
SAMPLES = {
    "precision": ("ddp", "bf16", "bf16"), "grad_accum": ("ddp", "3", 3),
    "activation_checkpointing": ("fsdp", "Block", "Block"), "seed": ("ddp", "7", 7),
    "grad_clip": ("ddp", "0.5", 0.5), "bucket_mb": ("ddp", "4", 4.0), "grad_as_bucket_view": ("ddp", None, True),
    "static_graph": ("ddp", None, True), "reshard_after_forward": ("fsdp", None, False),
    "wrap": ("fsdp", "Block,Attention", ("Block", "Attention")), "replicate": ("fsdp", "Embedding", ("Embedding",)),
    "dp_replicate": ("fsdp", "2", 2), "dp_shard": ("fsdp", "1", 1), "offload": ("zero3", "params", "params"),
    "overlap_comm": ("zero2", None, True), "contiguous_gradients": ("zero2", None, True),
    "reduce_bucket_mb": ("zero2", "2", 2.0), "allgather_bucket_mb": ("zero2", "2", 2.0),
    "micro_batch": ("zero1", "4", 4), "dp": ("fsdp", "2", 2), "tp": ("tp", "2", 2), "pp": ("pp", "2", 2),
    "sp": ("tp", None, True), "microbatches": ("pp", "4", 4), "schedule": ("pp", "gpipe", "gpipe"), "virtual_stages": ("pp", "2", 2),
    "ds_config": ("zero2", "{path}", {"zero_optimization": {"stage": 2}}),
    "checkpoint_every": ("ddp", "5", 5), "checkpoint_dir": ("ddp", "ckpts --checkpoint-every 5", "ckpts"),
    "reduce_every_micro_batch": ("fsdp", "--grad-accum 2", True),
    "memory_timeline": ("fsdp", "timelines", "timelines"), "timeline_steps": ("fsdp", "3 --memory-timeline", 3), "compress": ("ddp", "fp16", "fp16"), "compile": ("ddp", None, True),
}
NEEDS = {"checkpoint_dir": "checkpoint_every", "timeline_steps": "memory_timeline",
         "reduce_every_micro_batch": "grad_accum"}  # the other option a sample sets


def test_every_option_field_is_accepted_by_the_magic_and_lands_in_the_spec(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"zero_optimization": {"stage": 2}}')
    assert {f.name for f in OPTION_FIELDS} == set(SAMPLES), "a new option needs a sample here"
    for f in OPTION_FIELDS:
        strategy, text, expected = SAMPLES[f.name]
        line = f"{strategy} {flag_of(f)}" + (f" {text.format(path=cfg)}" if text is not None else "")
        spec = parse_strategy_line(line, "gloo", "cpu")
        assert getattr(spec, f.name) == expected, line
        others = {g.name for g in OPTION_FIELDS} - {f.name, NEEDS.get(f.name)}
        default = StrategySpec(strategy)
        assert all(getattr(spec, o) == getattr(default, o) for o in others), line  # nothing else moved


def test_options_refused_where_the_table_says_they_do_not_apply():
    for f in OPTION_FIELDS:
        applies = f.metadata["applies"]
        strategy = next((n for n in ("ddp", "fsdp", "zero2", "tp") if n not in applies), None)
        if strategy is None:
            continue
        _, text, _ = SAMPLES[f.name]
        line = f"{strategy} {flag_of(f)}" + (f" {text}" if text and "{" not in text else "")
        if f.name == "ds_config":
            continue  # needs a file; refused like the others (test_options)
        with pytest.raises(UsageError, match=f"{flag_of(f)} does not apply to {strategy}"):
            parse_strategy_line(line, "gloo", "cpu")


def test_help_lists_the_options_in_sections():
    doc = NbtoolMagics.distributed.__doc__
    for group in (*GROUPS, "run options", "cell options"):
        assert f"{group}:" in doc, group
    ddp = doc.index("ddp options:")
    assert doc.index("--bucket-mb", ddp) < doc.index("fsdp options:")


def test_engine_code_imports_no_display_code():
    code = ("import sys, nbtool.rank, nbtool.rank.bootstrap, nbtool.rank.strategies, nbtool.rank.recorder, "
            "nbtool.rank.watchdog, nbtool.rank.checkpoint, nbtool.rank.commbench, nbtool.rank.pipeline, "
            "nbtool.rank.tp_plan, nbtool.rank.example_models, nbtool.rank.parallel_layers, nbtool.rank.groups, "
            "nbtool.spec, nbtool.protocol\n"
            "bad = [m for m in sys.modules if m.startswith(('IPython.display', 'IPython.core.display', "
            "'ipywidgets', 'plotly', 'nbtool.widgets', 'ipylab', 'kaleido'))]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_message_keys_are_built_and_read_only_in_the_protocol_module():
    hits = subprocess.run(["grep", "-rn", 'startswith("nbtool', "nbtool"], capture_output=True, text=True,
                          cwd=ROOT).stdout.splitlines()
    assert all(h.startswith("nbtool/protocol.py") for h in hits), hits
    built = subprocess.run(["grep", "-rnE", 'f"nbtool(-hang|-stack|-commbench)?:\\{', "nbtool"], capture_output=True,
                           text=True, cwd=ROOT).stdout.splitlines()
    assert all(h.startswith("nbtool/protocol.py") for h in built), built


def test_the_spec_is_pure_and_shared():
    import nbtool.spec

    assert Path(nbtool.spec.__file__).parent.name == "nbtool"  # not under rank/: the kernel uses it too
    assert all(f.metadata.get("option") for f in fields(StrategySpec) if f.name != "name")


def test_parallel_layers_built_directly_start_as_the_linear_they_split(tmp_path):
    """Megatron's initialisation: the whole weight initialised with the rank's seed, this rank's part kept."""
    code = f"""
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore({str(tmp_path / 'store')!r}, 1))
from nbtool.rank.parallel_layers import ColumnParallelLinear, RowParallelLinear
torch.manual_seed(3); col = ColumnParallelLinear(8, 16)
torch.manual_seed(3); ref = nn.Linear(8, 16)
torch.manual_seed(4); row = RowParallelLinear(16, 8)
torch.manual_seed(4); ref2 = nn.Linear(16, 8)
print(torch.equal(col.weight, ref.weight), torch.equal(row.weight, ref2.weight),
      bool(col.bias.eq(0).all()), float(col.weight.abs().max()) > 0)
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True", "True"]
