"""Models nbtool did not write (Hugging Face Llama with GQA, GPT-2 with tied embeddings) under its strategies.

Tiny configs built in the ranks (no hub): checkpoints move between strategies
with identical weights (tied weights saved once and restored tied, the rotary
``inv_freq`` buffer neither saved nor required), and no strategy leaves
process-wide state behind (ZeRO-3 replaced ``torch.nn.functional.linear``).
"""
from __future__ import annotations

import pytest
from hf_cells import NANOGPT, SETUP, move_checkpoint  # tests/ is on sys.path under pytest

import nbtool
from nbtool import run_analysis

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf(ip, cluster):
    ip.run_cell(SETUP).raise_error()
    return ip


def test_no_strategy_leaves_torch_functions_patched(hf):
    hf.run_cell("%%distributed zero3 --quiet --no-metrics\n_hf_train(strategy, 'llama', steps=1)\n"
                "import torch.nn.functional as F\n_during = F.linear is torch._C._nn.linear").raise_error()
    hf.run_cell("%%distributed ddp --quiet --no-metrics\n_hf_train(strategy, 'llama', steps=1)\n"
                "import torch.nn.functional as F\n_after = F.linear is torch._C._nn.linear\n"
                "_note = ' '.join(strategy.describe().get('notes', []))").raise_error()
    hf.run_line_magic("dist_pull", "_during _after _note --rank 0")
    assert hf.user_ns["_during"] is False  # ZeRO-3 really patches it: the check below can fail
    assert hf.user_ns["_after"] is True
    assert "torch.nn.functional.linear" in hf.user_ns["_note"]


@pytest.fixture(scope="module")
def nano(hf):
    hf.run_cell(NANOGPT).raise_error()
    return hf


FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "nanogpt"]
_REFERENCE: dict = {}  # family -> ddp's losses


def _ddp_losses(nano, family, layers=2):
    if (family, layers) not in _REFERENCE:
        nano.run_cell(f"%%distributed ddp --quiet --no-metrics\n_ref = _losses(strategy, {family!r}, layers={layers})"
                      ).raise_error()
        nano.run_line_magic("dist_pull", "_ref --rank 0")
        _REFERENCE[family, layers] = nano.user_ns["_ref"]
    return _REFERENCE[family, layers]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["fsdp", "zero1", "zero2", "zero3", "tp", "tp --sp", "pp", "fsdp --tp 2",
                                      "fsdp --pp 2", "fsdp --activation-checkpointing"])
def test_every_strategy_trains_real_models_as_ddp_does(nano, family, strategy):
    """The same cell, fp32: every strategy's losses equal ddp's (1e-5 relative), or it refuses before training."""
    ref = _ddp_losses(nano, family)
    res = nano.run_cell(f"%%distributed {strategy} --quiet --no-metrics\n_run = _losses(strategy, {family!r})")
    if (family, strategy) == ("nanogpt", "tp --sp"):  # its attention cannot be split: refused, never trained wrong
        assert not res.success and "--sp splits every block's input" in str(res.error_in_exec)
        return
    res.raise_error()
    nano.run_line_magic("dist_pull", "_run --rank 0")
    run = nano.user_ns["_run"]
    assert len(run) == len(ref) and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(ref, run)), (ref, run)


SAVED_CELL = """%%distributed ddp {precision}--quiet --no-metrics
model = CONFIGS[{family!r}](2)
model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
_local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard (tp)
_params = {{_local(p).untyped_storage().data_ptr() for p in model.parameters()}}
_saved = {{}}
def _pack(t):  # every tensor autograd saves, by storage, less the parameters themselves
    st = _local(t).untyped_storage()
    if st.data_ptr() not in _params:
        _saved[st.data_ptr()] = st.nbytes()
    return t
x = torch.randint(0, 128, (4, 64))
with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
    loss = _lm_loss(model(x), x)
strategy.backward(loss); opt.step()
_act = sum(_saved.values())
from nbtool.plan.inputs import ModelShape
_shape = ModelShape.from_module(CONFIGS[{family!r}](2), seq=64)
"""


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_real_models_activations_equal_what_autograd_saves(nano, family, precision):
    """A Llama-style layer (RMSNorms in fp32, a gated MLP I wide, grouped-query k and v) and GPT-2's
    (whose gelu_new, tanh written as elementwise ops, saves 3 more 4h-wide tensors than GeLU) save what
    the planner counts for them, in fp32 and under autocast, within 8% (with Korthikanti's GPT layer and
    the attention heads unread from the config it predicted no activations at all for the Llama family,
    and half of GPT-2's; GPT-2's separate copies of k and v, +4 s b h in 16 bits, are not counted: it
    is 5-7% short). Not Mistral here: its sliding-window mask sends fp32 attention on CPU to SDPA's
    unfused kernel, which saves the scores (+11% on this shape; the planner counts fused attention)."""
    from nbtool.plan.estimate import activations
    from nbtool.plan.inputs import Training

    nano.run_cell(SAVED_CELL.format(family=family, precision="" if precision == "fp32" else "--precision bf16 ")
                  ).raise_error()
    nano.run_line_magic("dist_pull", "_act _shape --rank 0")
    shape = nano.user_ns["_shape"]
    assert shape.heads == 4 and ((shape.gated_mlp, shape.kv_heads, shape.mlp_extra) == (128, 2, 0) if family != "gpt2"
                                 else (shape.gated_mlp, shape.mlp_extra) == (None, 3))
    s, b, V = 64, 4, 128
    predicted = activations(shape, Training(micro_batch=b, seq=s, precision=precision), autocast=precision == "bf16")
    # less backward's two loss gradients, which are not saved tensors (the loss sees s - 1 positions)
    assert nano.user_ns["_act"] / (predicted - 8 * s * b * V) == pytest.approx(1, abs=0.08)


@pytest.mark.parametrize("line", ["tp", "tp --sp"])
def test_tensor_parallel_llama_saves_what_the_planner_counts(nano, line):
    """Under tp a Llama layer's q/k/v, o_proj input and MLP internals are split, its norms and the
    gathered inputs of q/k/v and gate/up are not (also under --sp: DTensor keeps them gathered; the
    planner divided them by tp, 8% short): the count equals autograd's saved bytes within 2%."""
    from nbtool.plan.estimate import activations
    from nbtool.plan.inputs import Training

    nano.run_cell(SAVED_CELL.replace("%%distributed ddp ", f"%%distributed {line} ").format(
        family="llama", precision="")).raise_error()
    nano.run_line_magic("dist_pull", "_act _shape --rank 0")
    s, b, V = 64, 4, 128
    predicted = activations(nano.user_ns["_shape"], Training(micro_batch=b, seq=s, precision="fp32"), tp=2,
                            sp="--sp" in line)
    assert nano.user_ns["_act"] / (predicted - 8 * s * b * V) == pytest.approx(1, abs=0.02)


def _llama_timeline(nano, line: str):
    """Predicted vs measured of a 2-layer Llama trained 3 steps under ``line`` with --memory-timeline."""
    nano.run_cell(f"%%distributed {line} --memory-timeline --quiet\n"
                  "model = CONFIGS['llama'](2)\n"
                  "model, opt = strategy.prepare(model, torch.optim.AdamW(model.parameters()))\n"
                  "for _ in range(3):\n"
                  "    x = torch.randint(0, 128, (8, 64))\n"
                  "    strategy.backward(_lm_loss(model(x), x)); opt.step(); opt.zero_grad()").raise_error()
    return nbtool.predicted_vs_measured()


def test_a_llama_runs_peak_tensors_are_predicted_within_tolerance(nano):
    """Predicted next to measured on a Llama under ddp in bf16 (autocast), with a batch whose activations
    make most of the peak: the planner's peak is within the 10% tolerance of the memory timeline's
    (it was -47%: no activations predicted)."""
    v = _llama_timeline(nano, "ddp --precision bf16")
    peak = v.row("peak tensor memory")
    assert peak.within, v.text()
    assert v.estimate.device["activations"] > 0.5 * peak.measured, v.text()  # what this test is about


def test_a_tensor_parallel_llamas_timeline_peak_holds_no_finished_all_reduce(nano):
    """Under tp, DTensor's all-reduces clone their input into a result that gloo's worker thread may
    let go of last, where torch's profiler records no free: the timeline had counted 1-6 of those
    results still held at the peak, a different number each run (6-12% over the planner's peak). Each
    is now taken as freed after the last op that read it: the same cell twice peaks within 2% of
    itself (one such result is 2.5%; what still differs is 8-16 KiB on one rank, 0.3%, and once
    1.0% under the whole suite's load) and 3% of the planner's (whose tp activations equal
    autograd's saved bytes). One more result had stayed counted in about one run in six, where the
    profiler's repeated allocation id gave it the key of the next tensor at its address, which
    torch's categorised timeline saw destroyed."""
    peaks = []
    for _ in range(2):
        v = _llama_timeline(nano, "tp")
        peak = v.row("peak tensor memory")
        assert abs(peak.error) < 0.03, v.text()
        peaks.append(peak.measured)
    assert abs(peaks[0] - peaks[1]) <= 0.02 * peaks[0], peaks


def test_fsdp_bf16_on_a_wide_llama_peaks_at_its_first_reduce_scatter(nano):
    """FSDP in bf16 gathers 16-bit weights but reduce-scatters fp32 gradients: with a unit's weights
    outweighing a layer's activations (hidden 256, batch 2 x 16), the step peaks as the last block's
    gradients are reduced (the next unit prefetched, the fp32 input, gloo's copy of it, the output
    shard), not at backward's start. The planner's typical step is within 5% of the timeline's (it was
    14% short with backward's start alone)."""
    from nbtool.plan.versus import typical_peak

    nano.run_cell("%%distributed fsdp --precision bf16 --memory-timeline --quiet\n"
                  "model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,\n"
                  "    num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))\n"
                  "model, opt = strategy.prepare(model, torch.optim.AdamW(model.parameters()))\n"
                  "for _ in range(4):\n"
                  "    x = torch.randint(0, 128, (2, 16))\n"
                  "    strategy.backward(model(input_ids=x, labels=x).loss); opt.step(); opt.zero_grad()").raise_error()
    v = nbtool.predicted_vs_measured()
    assert v.estimate.peak_phase == "first reduce-scatter", v.text()
    assert v.estimate.device_total / typical_peak(nbtool.last_run()) == pytest.approx(1, abs=0.05), v.text()


@pytest.mark.parametrize("family", ["llama", "nanogpt"])
def test_fsdp_reducing_every_micro_batch_trades_memory_for_bytes_as_predicted(nano, family):
    """fsdp --grad-accum holds each unit's gradients unsharded in fp32 from the first micro-batch to
    the last (torch's accumulation without communication); --reduce-every-micro-batch reduce-scatters
    each micro-batch's and adds up the shards. Both train as ddp does (fp32 losses), each run's bus
    bytes are the planner's exactly (the reduce-scatters twice with 2 micro-batches), each peak is
    within the 10% tolerance, and the peak falls by what the planner says."""
    from nbtool.plan.advice import measure
    from nbtool.plan.versus import typical_peak

    session = nano.magics_manager.registry["NbtoolMagics"].session
    ref = _accumulated_losses(nano, family, "ddp --grad-accum 2")
    runs = {}
    for line in ("fsdp --grad-accum 2", "fsdp --grad-accum 2 --reduce-every-micro-batch"):
        assert _accumulated_losses(nano, family, line) == pytest.approx(ref, rel=1e-5), line
        run, v = nbtool.last_run(), nbtool.predicted_vs_measured()
        bytes_row, peak = v.row("bus bytes / step"), v.row("peak tensor memory")
        assert bytes_row.within and abs(bytes_row.error) < 1e-3 and peak.within, v.text()
        runs[line] = run, v, session.advice
    (plain, v0, told), (every, v1, told_after) = runs.values()
    by_op = [run_analysis.summary(r)["comm_bytes_per_step"] for r in (plain, every)]
    assert by_op[1]["reduce_scatter"] == 2 * by_op[0]["reduce_scatter"], by_op
    # measured 148 kB for 181 predicted (Llama), 224 kB for 225 (nanoGPT): 9-12% of the peak
    saved, predicted = typical_peak(plain) - typical_peak(every), v0.estimate.device_total - v1.estimate.device_total
    assert predicted > 0 and saved == pytest.approx(predicted, rel=0.25), (saved, predicted)
    # advised where it saves a tenth of the predicted peak, and run as written the measured peak falls
    (s,) = [s for s in told if "--reduce-every-micro-batch" in s.line]
    assert s.line == "fsdp --grad-accum 2 --reduce-every-micro-batch --memory-timeline", s
    assert s.figure == "peak tensor memory" and s.predicted < s.before, s
    assert measure(every, "peak tensor memory") == pytest.approx(s.predicted, rel=0.1), s
    # and back: one reduce-scatter a window, faster, for the memory it costs
    (back,) = [s for s in told_after if s.line == "fsdp --grad-accum 2 --memory-timeline"]
    assert back.figure == "bus bytes / step" and back.predicted < back.before and "memory +" in back.effect, back


def test_modules_kept_whole_all_reduce_every_micro_batch_too(nano):
    """fsdp --replicate Embedding: the embeddings stay whole, their gradients all-reduced (PyTorch's
    FSDP2-based replicate); with --reduce-every-micro-batch that all-reduce comes once a micro-batch as
    well (32 -> 64 KiB a step here), and the bus bytes are the planner's exactly (a Llama; the cell's own
    all-reduce of its losses, 8 bytes a step, is the only difference)."""
    measured = []
    for line in ("fsdp --replicate Embedding --grad-accum 2",
                 "fsdp --replicate Embedding --grad-accum 2 --reduce-every-micro-batch"):
        _accumulated_losses(nano, "llama", line)
        v = nbtool.predicted_vs_measured()
        row = v.row("bus bytes / step")
        assert row.within and abs(row.error) < 1e-3 and v.row("peak tensor memory").within, v.text()
        measured.append(run_analysis.summary(nbtool.last_run())["comm_bytes_per_step"])
    loss = 8  # the cell's all-reduce of each micro-batch's 4-byte loss
    assert measured[1]["all_reduce"] - loss == 2 * (measured[0]["all_reduce"] - loss), measured
    assert measured[1]["reduce_scatter"] == 2 * measured[0]["reduce_scatter"], measured


def _accumulated_losses(nano, family: str, line: str) -> list:
    """Rank 0's losses of 3 optimizer steps of 2 micro-batches each under ``line``, with a memory timeline."""
    nano.run_cell(f"%%distributed {line} --memory-timeline --quiet\n"
                  f"_acc = _losses(strategy, {family!r}, steps=6)").raise_error()
    nano.run_line_magic("dist_pull", "_acc --rank 0")
    return nano.user_ns["_acc"]


@pytest.mark.parametrize("family", ["llama", "nanogpt"])
def test_the_planner_counts_the_all_reduces_of_the_parts_tp_split(nano, family):
    """Tensor parallelism all-reduces once forward and once backward per block part it splits: a Llama's
    attention and MLP, 4 a layer; nanoGPT's attention stays whole (its forward reshapes by the full width),
    so 2 a layer. The planner counts the parts the run's plan split: bus bytes per step exact, judged
    against the 2% tolerance (nanoGPT's had been predicted at 2x, and left unjudged)."""
    nano.run_cell(f"%%distributed tp --quiet\n_run = _losses(strategy, {family!r})").raise_error()
    v = nbtool.predicted_vs_measured()
    bus = v.row("bus bytes / step")
    assert bus.tolerance is not None and abs(bus.error) < 0.001, v.text()
    split = [n for n in v.notes if "per split block part" in n]
    assert bool(split) == (family == "nanogpt") and (not split or "split 2 of 4 attention and MLP parts" in split[0]), v.notes


@pytest.mark.parametrize("family", ["gpt2", "nanogpt"])
def test_the_planner_counts_weights_tied_across_pipeline_stages(nano, family):
    """GPT-2 and nanoGPT tie the embedding to the head: under pp both stages hold a copy and nbtool sums
    their gradients over pp every step. The planner counts the copy and the all-reduce: bus bytes per
    step exact (they were a third short)."""
    nano.run_cell(f"%%distributed pp --quiet\n_run = _losses(strategy, {family!r})").raise_error()
    v = nbtool.predicted_vs_measured()
    assert abs(v.row("bus bytes / step").error) < 0.001, v.text()


@pytest.mark.parametrize("family", ["llama", "gpt2", "nanogpt"])
@pytest.mark.parametrize("line", ["pp --schedule 1f1b", "pp --schedule zbv", "fsdp --pp 2"])
def test_the_planner_counts_each_pipeline_ranks_model_states_exactly(nano, family, line):
    """Each pipeline rank's parameters, gradients and optimizer state, judged exactly: its stages' blocks
    and the ends it runs (embeddings on the first stage's rank, final norm and head on the last's),
    counted from the model's parts before and after its blocks. Under ZB-V rank 0 runs both ends (GPT-2's
    tied embedding and head: one tensor there). The planner had split the model evenly: ZB-V's rank 0
    read 7% short, unjudged. FSDP over a dp of 1 holds what the replicas do (4 ranks: test_parallel_4ranks)."""
    schedule = "zbv" if "zbv" in line else "1f1b"
    nano.run_cell(f"%%distributed {line} --quiet\n"
                  "model = CONFIGS[" + repr(family) + "](4)\n"
                  "model, opt = strategy.prepare(model, torch.optim.AdamW(model.parameters()), loss_fn=_lm_loss)\n"
                  "for _ in range(2):\n"
                  "    strategy.forward_backward(_ids, _ids); opt.step(); opt.zero_grad()").raise_error()
    v = nbtool.predicted_vs_measured()
    ranks = [r for r in v.rows if r.figure.startswith("  model states, rank")]
    assert len(ranks) == 2 and ranks[0].measured != ranks[1].measured, v.text()  # the stages differ
    assert all(r.tolerance == 0 and r.within for r in ranks + [v.row("model states")]), v.text()
    assert (ranks[0].measured > ranks[1].measured) == (schedule == "zbv" or family != "llama"), v.text()


@pytest.mark.parametrize("family", ["llama", "gpt2", "nanogpt"])
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_schedules_with_two_stages_per_rank_train_real_models_as_ddp_does(nano, family, schedule):
    """4 blocks as 4 stages on 2 ranks. Interleaved: rank 0 runs stages 0 and 2, so GPT-2's tied
    embedding and head sit on different ranks; ZB-V: rank 0 runs stages 0 and 3, both copies of the
    tied weight on one rank, one tensor whose gradient both stages add to, scaled once."""
    ref = _ddp_losses(nano, family, layers=4)
    nano.run_cell(f"%%distributed pp --schedule {schedule} --quiet --no-metrics\n"
                  f"_run = _losses(strategy, {family!r}, layers=4)\n_stage = strategy.describe()['stage']").raise_error()
    nano.run_line_magic("dist_pull", "_run _stage --rank 0")
    run = nano.user_ns["_run"]
    assert nano.user_ns["_stage"].startswith("stages 0, 3 of 4" if schedule == "zbv" else "stages 0, 2 of 4")
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(ref, run)) and len(run) == len(ref), (ref, run)


# every strategy saves once and loads once (a cycle), plus zero3 into itself
PAIRS = [("ddp", "zero3"), ("zero3", "fsdp"), ("fsdp", "tp"), ("tp", "pp"), ("pp", "fsdp --pp 2"),
         ("fsdp --pp 2", "zero1"), ("zero1", "zero2"), ("zero2", "ddp"), ("zero3", "zero3")]


@pytest.mark.parametrize("family", ["llama", "gpt2", "nanogpt"])
@pytest.mark.parametrize("first,second", PAIRS)
def test_checkpoints_move_between_strategies(nano, tmp_path, family, first, second):
    """Weights saved under one strategy load under another identically (tied weights restored tied,
    the rotary inv_freq buffer neither saved nor required, fused q/k/v back in [q | k | v] order)."""
    ok, tied, _ = move_checkpoint(nano, family, first, second, str(tmp_path / f"{family}-{first}"))
    assert ok is True
    if family != "llama":
        assert tied is True


def test_pipeline_refuses_a_forward_it_does_not_reproduce(nano):
    """A nanoGPT-style model whose forward scales the embeddings: nbtool's stages would train another model."""
    nano.run_cell("%%distributed --quiet\nclass _Scaled(GPT):\n    def forward(self, idx, targets=None):\n"
                  "        x = 2.0 * self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))\n"
                  "        for b in self.transformer.h:\n            x = b(x)\n"
                  "        return self.lm_head(self.transformer.ln_f(x)), None\n"
                  "CONFIGS['scaled'] = lambda layers=2: _Scaled(layers=layers)").raise_error()
    res = nano.run_cell("%%distributed pp --quiet --no-metrics\n_losses(strategy, 'scaled')")
    text = str(res.error_in_exec)
    assert not res.success and "_Scaled's own forward does more than nbtool's gpt stages run" in text
    assert "their logits differ" in text


@pytest.mark.parametrize("family", ["llama", "nanogpt"])
def test_tensor_parallel_describes_what_it_split(nano, family):
    nano.run_cell(f"%%distributed tp --quiet --no-metrics\n_losses(strategy, {family!r}, steps=1)\n"
                  "_notes = ' '.join(strategy.describe().get('notes', []))\n"
                  "_plan = strategy.describe().get('plan', {})").raise_error()
    nano.run_line_magic("dist_pull", "_notes _plan --rank 0")
    if family == "nanogpt":  # its forward reshapes by the full width: c_attn stays whole, and says so
        assert "replicated" in nano.user_ns["_notes"] and "attn.c_attn (Linear)" in nano.user_ns["_notes"]
    else:
        assert "replicated" not in nano.user_ns["_notes"]
        plan = nano.user_ns["_plan"]  # GQA: 2 key/value heads, one per rank (k_proj column-parallel)
        assert plan["model.layers.0.self_attn.k_proj"].startswith("Colwise")
        assert plan["model.layers.1.mlp.down_proj"].startswith("Rowwise")


def test_gpt2_fused_attention_is_split_by_heads(nano):
    """GPT-2's Conv1D c_attn: each rank holds its heads' q, k and v (split_size halves), not a column slice."""
    nano.run_cell("%%distributed tp --quiet --no-metrics\n_losses(strategy, 'gpt2', steps=1)\n"
                  "_d = strategy.describe()\n_local = strategy.model.transformer.h[0].attn.c_attn.weight.to_local()\n"
                  "_shape = tuple(_local.shape)").raise_error()
    nano.run_line_magic("dist_pull", "_d _shape --rank 0")
    d = nano.user_ns["_d"]
    assert "transformer.h.0.attn.split_size 64 -> 32 per rank" in d["heads"]
    assert nano.user_ns["_shape"] == (64, 96)  # Conv1D (in, out): a third of each of q, k, v per rank
    assert "notes" not in d or "replicated" not in " ".join(d["notes"])


def test_sequence_parallel_refuses_what_it_cannot_split(nano):
    res = nano.run_cell("%%distributed tp --sp --quiet --no-metrics\n_losses(strategy, 'nanogpt')")
    text = str(res.error_in_exec)
    assert not res.success and "--sp splits every block's input" in text
    assert "transformer.h.0.attn.c_attn (Linear)" in text


def test_zero3_says_what_it_keeps_whole(hf, capsys):
    """DeepSpeed's persistence threshold (1e5 elements) keeps small tensors whole: the summary says so."""
    capsys.readouterr()
    res = hf.run_cell("%%distributed zero3 --no-metrics\n_hf_train(strategy, 'llama', steps=1)")
    out = capsys.readouterr().out
    assert res.success
    assert "parameter tensors" in out and "stay whole on every rank" in out
    assert "stage3_param_persistence_threshold = 100000 elements" in out


def test_fsdp_shards_each_block_by_default(hf):
    hf.run_cell("%%distributed fsdp --quiet --no-metrics\n_hf_train(strategy, 'llama', steps=1)\n"
                "_units = strategy.describe()['units']").raise_error()
    hf.run_cell("%%distributed fsdp --wrap none --quiet --no-metrics\n_hf_train(strategy, 'llama', steps=1)\n"
                "_one = strategy.describe()['units']").raise_error()
    hf.run_cell("%%distributed fsdp --activation-checkpointing --quiet --no-metrics\n"
                "_hf_train(strategy, 'llama', steps=1)\n_ac = strategy.describe()['activation_checkpointing']").raise_error()
    hf.run_line_magic("dist_pull", "_units _one _ac --rank 0")
    assert hf.user_ns["_ac"] == "2 x LlamaDecoderLayer"  # the same blocks, recomputed in backward
    # LlamaForCausalLM._no_split_modules = ["LlamaDecoderLayer"]: each layer a unit, then the root
    assert hf.user_ns["_units"] == ["model.layers.1", "model.layers.0", "<root>"]
    assert hf.user_ns["_one"] == ["<root>"]


def test_zero3_cells_keep_rank_memory_flat(hf):
    """20 zero3 cells in a row: a rank's RSS (the OS's figure for the whole process) stays within 10 MB
    after the first cells warm up; nothing a strategy builds outlives its cell."""
    hf.run_cell("%%distributed --quiet\nimport gc, psutil\n_rss = []").raise_error()
    for _ in range(20):
        hf.run_cell("%%distributed zero3 --quiet --no-metrics\n_hf_train(strategy, 'llama', steps=1)\n"
                    "gc.collect()\n_rss.append(psutil.Process().memory_info().rss)").raise_error()
    hf.run_line_magic("dist_pull", "_rss --rank 0")
    rss = hf.user_ns["_rss"]
    assert len(rss) == 20
    growth = (max(rss[4:]) - rss[4]) / 2**20
    assert growth < 10, [round((x - rss[0]) / 2**20, 1) for x in rss]
