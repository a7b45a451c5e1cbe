"""The planner: ZeRO paper figures, DeepSpeed's own estimators, measured ledgers, rules of thumb."""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import replace

import pytest
import torch

from nbtool.rank.example_models import TinyTransformer
from nbtool.plan import paper_bytes
from nbtool.plan.estimate import DDP_INFLIGHT, REDUCE_BUCKET, activations, estimate, pipeline_holdings
from nbtool.plan.inputs import HARDWARE_PRESETS, MODEL_PRESETS, Hardware, ModelShape, Training, cublas_workspace
from nbtool.plan.model_states import expected_ledger
from nbtool.plan.recommend import recommend

GB = 1e9


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, expected_gb):
    """Rajbhandari et al. 2020, figure 1: a 7.5B model on 64 GPUs with mixed-precision Adam (K=12)."""
    assert sum(paper_bytes(stage, 7.5e9, 64).values()) / GB == pytest.approx(expected_gb, abs=0.05)


def _model_states(e):
    return sum(e.states.values())


def _device_states(e):
    """The model states the peak's figures are built from (ZeRO in mixed precision: DeepSpeed's estimator's)."""
    return sum(e.estimator_states.values())


@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 8), (4, 4)])
def test_matches_deepspeed_estimators(nodes, per_node):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    m = MODEL_PRESETS["13B (Llama-2-13B shape)"]
    hw = HARDWARE_PRESETS["8x A100-80GB NVLink"].scaled(nodes=nodes, devices_per_node=per_node)
    t = Training(precision="bf16", optimizer="adamw")
    psi = m.params
    est = {name: estimate(name, m, t, hw) for name in
           ("zero2", "zero2-offload", "zero3", "zero3-offload-optimizer", "zero3-offload")}

    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, per_node, nodes, cpu_offload=False)
    assert _device_states(est["zero2"]) == pytest.approx(gpu, abs=2)
    assert est["zero2"].device["buffers"] == 2 * REDUCE_BUCKET
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, per_node, nodes, cpu_offload=True)
    assert _device_states(est["zero2-offload"]) == pytest.approx(gpu, abs=2)
    assert est["zero2-offload"].host == pytest.approx(cpu, rel=1e-9)

    for name, off, off_params in (("zero3", False, False), ("zero3-offload-optimizer", True, False),
                                  ("zero3-offload", True, True)):
        cpu, gpu, largest = estimate_zero3_model_states_mem_needs(psi, m.largest_layer, per_node, nodes,
                                                                  cpu_offload=off, cpu_offload_params=off_params)
        e = est[name]
        # plus the reduce bucket DeepSpeed allocates and its estimator leaves out (16-bit gradients)
        assert _device_states(e) + e.device["buffers"] == pytest.approx(gpu + 2 * REDUCE_BUCKET, abs=2), name
        assert e.device["buffers"] == largest + 2 * REDUCE_BUCKET
        if off:
            assert e.host == pytest.approx(cpu, rel=1e-9), name
    # what the ranks own over a step (the table's "model states", against the recorder's ledger) is the
    # ledger theory's, offloaded states included, not the estimator's figures at their moment
    for name, offload in (("zero2", None), ("zero2-offload", "optimizer"), ("zero3", None),
                          ("zero3-offload-optimizer", "optimizer"), ("zero3-offload", "both")):
        led = expected_ledger(name[:5], "bf16", [psi], nodes * per_node, offload=offload)
        assert _model_states(est[name]) == sum(led.values()) != _device_states(est[name]), name


def test_fp32_offload_moves_the_optimizers_states_to_the_host_on_gpus():
    """fp32 ZeRO with offload (the ledger theory's figures, no estimator for it): on GPUs DeepSpeed's CPU
    optimizer holds the fp32 partition and its states on the host, and --offload both ZeRO-3's parameter
    partitions; the ranking had shown them on the device, as without offload. On CPU ranks the host is
    the device, and nothing moves."""
    m = ModelShape(int(1e8))
    t = Training(precision="fp32")
    gpu = HARDWARE_PRESETS["8x A100-40GB NVLink"]
    plain, opt, both = (estimate(name, m, t, gpu) for name in ("zero3", "zero3-offload-optimizer", "zero3-offload"))
    assert "optimizer" not in opt.device and opt.host == plain.device["optimizer"] * 8
    assert "params" not in both.device and both.host == (plain.device["optimizer"] + plain.device["params"]) * 8
    assert both.device_total < opt.device_total < plain.device_total
    two = estimate("zero2-offload", m, t, gpu)
    assert "optimizer" not in two.device and two.offload_s == pytest.approx((4 + 4) * m.params / 8 / gpu.host_link_bw)
    cpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    on_cpu, plain_cpu = estimate("zero2-offload", m, t, cpu), estimate("zero2", m, t, cpu)
    assert on_cpu.device["optimizer"] == plain_cpu.device["optimizer"] and on_cpu.host == 0


LEDGER_SETUP = """%%distributed --quiet
from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
def _one_step(strategy, steps=1):
    m = TinyTransformer()
    model, opt = strategy.prepare(m, torch.optim.AdamW(m.parameters()))
    for _, (x, y) in zip(range(steps), strategy.dataloader(SyntheticTokens(16), batch_size=2)):
        strategy.backward(lm_loss(model(x), y)); opt.step(); opt.zero_grad()
    return strategy.memory_ledger()
"""


@pytest.mark.parametrize("layout,line", [("ddp", "ddp"), ("fsdp", "fsdp"), ("zero1", "zero1"),
                                         ("zero2", "zero2"), ("zero3", "zero3")])
def test_predicted_model_states_equal_measured_ledger(ip, cluster, layout, line):
    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell(f"%%distributed {line} --quiet --no-metrics\n_led = _one_step(strategy)").raise_error()
    ip.run_line_magic("dist_pull", "_led")
    m = ModelShape.from_module(TinyTransformer())
    e = estimate(layout, m, Training(precision="fp32"), HARDWARE_PRESETS["2 CPU ranks (gloo)"])
    for led in ip.user_ns["_led"]:
        assert e.states["params"] == led.params
        assert e.states["grads"] == led.grads
        assert e.states["optimizer"] == led.master_params + led.optimizer_state + led.other


def test_cublas_workspace_term_is_on_gpus_only_and_follows_the_workspace_config():
    mib = 2**20
    assert cublas_workspace(9) == 64 * mib  # 2 x 32 MiB on Hopper: measured on an H200 by gpu_check.py
    assert cublas_workspace(8) == 2 * (8 * mib + 128 * 1024)  # PyTorch's :4096:2:16:8 before Hopper
    assert cublas_workspace(9, ":4096:8") == 64 * mib and cublas_workspace(8, ":16:8") == 256 * 1024
    model, t = MODEL_PRESETS["GPT-2 small (124M)"], Training(micro_batch=1)
    gpu = estimate("ddp", model, t, HARDWARE_PRESETS["8x H100-80GB NVLink"])
    cpu = estimate("ddp", model, t, HARDWARE_PRESETS["2 CPU ranks (gloo)"])
    assert gpu.device["workspace"] == 64 * mib and "workspace" not in cpu.device


def test_from_module_counts_on_the_meta_device():
    with torch.device("meta"):
        big = TinyTransformer(vocab=50000, dim=1024, heads=16, layers=8)
    shape = ModelShape.from_module(big, seq=16)
    assert shape.params == sum(p.numel() for p in big.parameters())
    assert shape.largest_layer == 1024 * 50000 + 50000  # the LM head (weight + bias) is the largest module
    assert (shape.layers, shape.hidden, shape.vocab, shape.heads) == (8, 1024, 50000, 16)


def test_commbench_numbers_replace_defaults():
    from nbtool.commbench import CommbenchResult, Fit

    res = CommbenchResult("gloo", [0, 1], "float32", 10, 2, False,
                          fits={"all_reduce": Fit(123e-6, 1.5e9, 0.99, 0.05, 8)})
    hw = HARDWARE_PRESETS["2 CPU ranks (gloo)"].with_commbench(res)
    assert (hw.intra_latency, hw.intra_bw, hw.measured) == (123e-6, 1.5e9, True)


RULES = [
    # seed rule 1: 1-4 GPUs and a small model -> DDP
    ("GPT-2 small (124M)", HARDWARE_PRESETS["4x RTX 4090 PCIe"], Training(micro_batch=8), "ddp",
     ["DDP fits with", "GB per device"]),
    # seed rule 2: memory tight on a handful of GPUs (8 x A100) -> FSDP + bf16
    ("7B (Llama-2-7B shape)", HARDWARE_PRESETS["8x A100-40GB NVLink"],
     Training(micro_batch=1, checkpointing="full"), "fsdp", ["FSDP", "does not fit: needs"]),
    # seed rule 3: extreme memory pressure (> 16 GPUs' worth of states) -> ZeRO-3 + CPU offload
    ("70B-class (80L, 8192h)", HARDWARE_PRESETS["8x A100-40GB NVLink"].scaled(nodes=2),
     Training(micro_batch=1, checkpointing="full"), "zero3-offload", ["ZeRO-3 + CPU offload", "host"]),
    # seed rule 4: hundreds of billions of parameters on a fast network -> Megatron TP + PP (FSDP over dp)
    ("GPT-3 175B", HARDWARE_PRESETS["8x A100-80GB NVLink"].scaled(nodes=16),
     Training(micro_batch=1, grad_accum=16, checkpointing="selective"), "tp-pp",
     ["Megatron TP 8 x PP 4 x FSDP 4", "bubble"]),
    # on half the nodes, one micro-batch a step: TP inside each node, FSDP over the nodes sharding the rest
    # (torchtitan's 2D); its states counted whole over dp, it had not fit, and TP 8 x PP 8 took its place.
    ("GPT-3 175B", HARDWARE_PRESETS["8x A100-80GB NVLink"].scaled(nodes=8),
     Training(micro_batch=1, checkpointing="selective"), "tp", ["Megatron TP 8 x PP 1 x FSDP 8"]),
    # With 16 micro-batches FSDP accumulating them in unsharded fp32 gradients (87.5 GB) does not fit;
    # reduce-scattering each micro-batch's it does, and beats TP 8 x PP 8 (no bubble, 8x the samples a step)
    ("GPT-3 175B", HARDWARE_PRESETS["8x A100-80GB NVLink"].scaled(nodes=8),
     Training(micro_batch=1, grad_accum=16, checkpointing="selective"), "tp",
     ["Megatron TP 8 x PP 1 x FSDP 8, reducing every micro-batch fits", "Megatron TP 8 x PP 1 x FSDP 8 does not fit",
      "Megatron TP 8 x PP 8 x DP 1 fits"]),
]


@pytest.mark.parametrize("model,hw,training,family,mentions", RULES,
                         ids=["ddp", "fsdp", "zero3-offload", "tp-pp", "tp-fsdp", "tp-fsdp-accumulating"])
def test_rules_of_thumb(model, hw, training, family, mentions):
    rec = recommend(MODEL_PRESETS[model], training, hw)
    assert rec.best is not None and str(rec.best.layout).startswith(family), str(rec)
    text = str(rec)
    for phrase in mentions:
        assert phrase in text
    first = rec.lines()[0]
    assert first.startswith(mentions[0]), first  # the choice itself ("tp" is also the start of "tp-pp")
    assert "headroom" in first and "GB" in first and "ms per sample" in first  # the deciding numbers


def test_ddp_is_rejected_with_its_numbers_when_memory_is_tight():
    rec = recommend(MODEL_PRESETS["7B (Llama-2-7B shape)"], Training(micro_batch=1, checkpointing="full"),
                    HARDWARE_PRESETS["8x A100-40GB NVLink"])
    line = next(l for l in rec.lines() if l.startswith("DDP does not fit"))
    # at the optimizer step: 16 bytes of states per parameter, DDP's bucket copy of the gradients and
    # foreach Adam's temporary (an fp32 copy of the parameters: 26.4 GB each); checkpointing leaves
    # backward's start lower
    assert "needs 158.2 GB > 38.7 GB usable per device" in line and "optimizer 52.7 GB" in line
    assert "buffers 52.7 GB" in line and line.endswith("at the optimizer step)")


def test_nothing_fits_says_what_would():
    tiny = Hardware("1 small GPU", 1, 1, 8e9, 16e9, 1e9, 1e9)
    rec = recommend(MODEL_PRESETS["13B (Llama-2-13B shape)"], Training(micro_batch=4), tiny)
    assert rec.best is None
    assert rec.advice[0].startswith("Nothing fits; the closest is")
    assert any("would fit" in a for a in rec.advice[1:])


def test_dist_plan_text_and_the_line_it_suggests_runs(ip, cluster, capsys):
    ip.run_line_magic("dist_plan", "--text --model 6.6e9 --hardware a100-40gb --checkpointing full")
    out = capsys.readouterr().out
    assert "6.6B parameters on 8 x 42.9 GB = 40 GiB" in out
    assert " 1. FSDP (grad-op sharding) fits with" in out
    assert "run it: %%distributed fsdp --no-reshard-after-forward --precision bf16 --activation-checkpointing" in out


@pytest.mark.parametrize("line,fragment", [
    ("--hardware tpu", "--hardware 'tpu' is not a preset; presets: 8x A100-40GB NVLink"),
    ("--hardware a100", "--hardware 'a100' matches several presets"),
    ("--model llama", "--model 'llama' matches several presets"),
    ("--model 0", "the parameter count must be >= 1"),
    ("--model nosuch.json", "--model 'nosuch.json': no such file"),
    ("--model _a_list", "--model _a_list: a list, not a torch module, a Hugging Face config"),
    ("--precision fp8", "invalid choice: 'fp8'"),
    ("--vs nosuch", "--vs 'nosuch': no "),  # "recorded runs yet" or "run named", by test order
    ("--vs-last --vs ddp", "--vs 'ddp' and --vs-last: give one"),
    ('--vs "fsdp --wrap Nosuch"', "--vs 'fsdp --wrap Nosuch': no "),  # a quoted name with spaces
    ("--vs-last --model 7e9", "--model applies to the ranking, not to --vs/--vs-last"),
    ("--vs ddp --hardware a100-40gb", "--hardware applies to the ranking, not to --vs/--vs-last"),
    ("--vs ddp --precision fp32", "--precision applies to the ranking"),
    ("--deterministic", "--deterministic applies with --vs NAME or --vs-last"),
    ("--calibrate-on nosuch", "--calibrate-on 'nosuch': "),
    ("--hardware a100-40gb --calibrate-on ddp", "--calibrate-on 'ddp': a run calibrates this cluster's figures; "
                                                "drop --hardware"),
])
def test_dist_plan_refusals(ip, line, fragment):
    from IPython.core.error import UsageError

    ip.user_ns["_a_list"] = [1, 2]
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("dist_plan", f"--text {line}")
    assert fragment in str(info.value)


@pytest.mark.parametrize("preset,config", [
    ("Llama-3-8B", dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
    ("Mistral-7B", dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)),
    ("Qwen2.5-7B", dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)),
])
def test_presets_count_what_the_models_hold(preset, config):
    """The exact presets against a second count: transformers builds each model from its published
    config on the meta device, and nbtool counts its parameters."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    counted = ModelShape.from_config(AutoConfig.for_model(config["model_type"], **fields))
    assert MODEL_PRESETS[preset].params == counted.params
    assert counted.layers == config["num_hidden_layers"] and counted.hidden == config["hidden_size"]
    # what a pipeline's first and last stages keep besides their blocks: the embedding; norm and head
    assert [sorted(part) for part in MODEL_PRESETS[preset].ends] == [sorted(part) for part in counted.ends]


def test_a_pipelines_slowest_stage_sets_its_pace():
    """Llama-3-8B over 4 pipeline ranks: the last stage runs 8 blocks and the head (a 128256-wide matmul,
    2.4 blocks' worth), 30% of the step's FLOPs where the others run 23% (the embedding is a lookup).
    Rank 0's compute is its own stages'; it waits for the slowest stage's extra, in its bubble with the
    other stages' warm-up and drain. The even split had put every rank at 25%: plan_accuracy's
    vocabulary-8192 shape (a head 5 blocks' worth), predicted from fsdp on 2 CPU ranks, went from
    -26.4% to -16.3% (1F1B) and -29.8% to -6.5% (ZB-V)."""
    from dataclasses import replace

    from nbtool.plan.estimate import pipeline_work
    from nbtool.spec import bubble_fraction

    m, hw = MODEL_PRESETS["Llama-3-8B"], HARDWARE_PRESETS["8x A100-80GB NVLink"]
    t = Training(micro_batch=1, grad_accum=8)
    shares = pipeline_work(m, 4)
    assert shares[:3] == [pytest.approx(0.2325, abs=1e-4)] * 3 and shares[3] == pytest.approx(0.3025, abs=1e-4)
    e, even = estimate("pp", m, t, hw, pp=4), estimate("pp", replace(m, ends=()), t, hw, pp=4)
    assert e.compute_s == pytest.approx(even.compute_s * 4 * shares[0])
    f = bubble_fraction(4, 8)
    assert e.bubble_s == pytest.approx(e.compute_s * f / (1 - f) + e.compute_s * (shares[3] / shares[0] - 1))
    assert even.bubble_s == pytest.approx(even.compute_s * f / (1 - f))
    assert pipeline_work(m, 4, 2, "zbv")[0] == shares[3]  # ZB-V: rank 0 runs the last stage too


def test_a_pipelines_first_rank_holds_the_embedding_with_its_blocks():
    """Llama-3-8B over 4 pipeline ranks: rank 0 holds 8 blocks and the 525M-element embedding, the last
    8 blocks, the final norm and the head (2.27B elements each); an even split (2.01B) put both 12% short.
    Under ZB-V rank 0 runs both ends (2.80B: 28%). A formula's shape counts one parameter tensor in all."""
    m = MODEL_PRESETS["Llama-3-8B"]
    block = (m.params - 2 * 128256 * 4096 - 4096) / 32
    one = pipeline_holdings(m, 4)
    assert one[0][0] == pytest.approx(8 * block + 128256 * 4096) and one[1][0] == pytest.approx(8 * block)
    assert one[3][0] == pytest.approx(8 * block + 4096 + 128256 * 4096) and sum(e for e, _ in one) == m.params
    v = pipeline_holdings(m, 4, 2, "zbv")
    assert v[0][0] == pytest.approx(8 * block + m.params - 32 * block) and v[1][0] == pytest.approx(8 * block)
    assert sum(t for _, t in v) == 1
    e = estimate("pp", m, Training(micro_batch=1, precision="fp32", optimizer="adamw"), HARDWARE_PRESETS["8x A100-80GB NVLink"],
                 pp=4)
    assert e.states["params"] == pytest.approx(4 * one[3][0]) and len(e.rank_states) == 4
    assert "pipeline ranks 0-3 hold 2.27B / 1.74B / 1.74B / 2.27B parameters" in " ".join(e.notes), e.notes


def test_dist_plan_takes_the_users_model(ip, tmp_path, capsys):
    """--model as a kernel variable (a module, a Hugging Face config), a config JSON file, or a count."""
    import json

    from transformers import GPT2Config, LlamaConfig

    ip.user_ns["_cfg"] = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    ip.run_cell("from nbtool.rank.example_models import TinyTransformer\n_tiny = TinyTransformer()").raise_error()
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps({"model_type": "gpt2", **GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                                                   bos_token_id=0, eos_token_id=0).to_diff_dict()}))
    tiny = sum(p.numel() for p in ip.user_ns["_tiny"].parameters())
    # Llama: 2 layers of (2*64*64 + 2*64*32 attention + 3*64*128 MLP + 2*64 norms), embeddings and head, final norm
    llama = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 2 * 128 * 64 + 64
    for arg, count in (("_cfg", llama), ("_tiny", tiny), (str(path), None), ("722k", 722_000)):
        capsys.readouterr()
        ip.run_line_magic("dist_plan", f"--text --model {arg} --hardware a100-40gb")
        out = capsys.readouterr().out
        first = out.splitlines()[0]
        if count is not None:
            assert f"{count / 1e3:.3g}K parameters" in first, first
        else:
            assert first.startswith("gpt2.json (gpt2): ")
        assert "0.0 GB" not in out and " MB " in out  # a small model's figures in MB or KB


def test_dist_plan_on_this_cluster_uses_measured_links(ip, cluster, capsys):
    ip.run_line_magic("commbench", "--sizes 1KB:1MB --factor 32 --iters 2")
    capsys.readouterr()
    ip.run_line_magic("dist_plan", "--text --model 1e8 --micro-batch 2 --seq 128")
    out = capsys.readouterr().out
    assert "2 CPU ranks (gloo, this machine), partly measured: the line above)" in out


def test_vs_last_compares_prediction_with_the_ledger(ip, cluster, capsys):
    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell("%%distributed zero2 --quiet\n_led = _one_step(strategy)").raise_error()
    capsys.readouterr()
    ip.run_line_magic("dist_plan", "--vs-last --deterministic")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "predicted vs measured, run 'zero2'"
    states = next(line for line in lines if line.startswith("model states"))
    assert "+0.0% ok" in states and "ledger" in states  # predicted bytes equal what each rank holds
    assert not any(line.startswith("step time") for line in lines)  # times vary run to run: not shown


def test_vs_last_says_when_the_last_run_failed(ip, cluster, capsys):
    """--vs-last shows a run that raised as far as it got, and says it failed; --vs NAME is the recorded
    run of that name, the one before it."""
    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell("%%distributed zero2 --quiet\n_led = _one_step(strategy)").raise_error()
    assert not ip.run_cell("%%distributed zero2 --quiet\n_led = _one_step(strategy)\nraise RuntimeError('boom')").success
    capsys.readouterr()
    ip.run_line_magic("dist_plan", "--vs-last --deterministic")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("the last run, 'zero2', failed: its figures are as far as it got"), lines
    assert lines[1] == "predicted vs measured, run 'zero2'"
    ip.run_line_magic("dist_plan", "--vs zero2 --deterministic")
    assert capsys.readouterr().out.startswith("predicted vs measured, run 'zero2'")


def test_dist_plan_calibrates_on_the_latest_run(ip, cluster, capsys):
    """After a strategy run, %dist_plan on this cluster uses the run's link fit and compute rate."""
    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell("%%distributed fsdp --quiet\n_led = _one_step(strategy, steps=3)").raise_error()
    capsys.readouterr()
    ip.run_line_magic("dist_plan", "--text --model 1e8 --micro-batch 2 --seq 128")
    out = capsys.readouterr().out
    assert "measured on this cluster: link (alpha " in out and "GFLOP/s achieved; time outside communication x" in out, out
    # CPU ranks: the host-cost model's speed, and how fast bf16 computes here (the ranks' probe)
    speed = re.search(r"the CPU reference's; bf16 at [0-9.e+]+ GFLOP/s, x([0-9.e+-]+) fp32's, measured\) from run 'fsdp'",
                      out)
    assert speed, out
    # bf16 (this request's precision) emulated: the text says so, with fp32's predicted step next to it
    note = re.search(r"with --precision fp32 the best choice's step is predicted at (\d+) ms, against (\d+) ms", out)
    assert bool(note) == (float(speed.group(1)) < 1), out
    assert not note or int(note.group(1)) < int(note.group(2)), out


def test_dist_plan_without_model_plans_the_last_runs_model_as_it_trained(ip, cluster, capsys):
    """After a run, %dist_plan with no --model ranks the model that run trained (its parameter count,
    micro-batch, sequence and precision), not a preset; what is given still wins, --model too."""
    from nbtool.plan.inputs import ModelShape

    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell("%%distributed ddp --quiet --no-watch\n_led = _one_step(strategy, steps=2)").raise_error()
    capsys.readouterr()
    ip.run_line_magic("dist_plan", "--text")
    out = capsys.readouterr().out
    params = ModelShape.from_module(TinyTransformer()).params
    assert "planning the model run 'ddp' trained" in out, out
    header = next(line for line in out.splitlines() if line.startswith("the model of run 'ddp': "))
    from nbtool.plan.inputs import format_count

    assert f": {format_count(params)} parameters on 2 x " in header and "; fp32, micro-batch 2," in header, header
    ip.run_line_magic("dist_plan", "--text --micro-batch 8 --precision bf16")
    assert "; bf16, micro-batch 8," in capsys.readouterr().out
    # the picker offers it by name, with the same ranking
    from nbtool.actions.plan import last_run_model
    from nbtool.widgets.picker import Picker

    magics = ip.magics_manager.registry["NbtoolMagics"]
    _, shape, _ = last_run_model(magics.session)
    p = Picker(shape=shape)
    assert p.model.value == "the model of run 'ddp'" and p.model_shape().params == params
    assert "DDP" in list(p.fig.data[0].x)
    ip.run_line_magic("dist_plan", "--text --model 1e8")
    out = capsys.readouterr().out
    assert "planning the model run" not in out and "100M params: 100M parameters" in out, out


def test_picker_updates_and_apply_round_trips(ip, cluster, tmp_path):
    from nbtool.magics import parse_strategy_line
    from nbtool.widgets.picker import Picker

    class Shell:
        def __init__(self):
            self.next = None

        def set_next_input(self, text, replace=False):
            self.next = text

    shell = Shell()
    p = Picker(model="7B (Llama-2-7B shape)", shell=shell)
    p.hardware.value = "8x A100-40GB NVLink"
    before = p.updates
    p.checkpointing.value = "full"
    assert p.updates == before + 1
    labels = list(p.fig.data[0].x)
    assert "DDP" in labels and "ZeRO-3" in labels
    ddp = labels.index("DDP")
    assert sum(p.fig.data[i].y[ddp] for i in range(5)) > p.fig.data[5].y[0]  # DDP over the capacity line
    assert p.choice.options[0][0].startswith("FSDP (grad-op sharding): %%distributed fsdp")
    p.apply()
    line = shell.next.splitlines()[0]
    assert line == p.apply_line()
    spec = parse_strategy_line(line[len("%%distributed "):])
    assert (spec.name, spec.precision, spec.reshard_after_forward, spec.activation_checkpointing) == \
        ("fsdp", "bf16", False, "")
    # a ZeRO choice exports the DeepSpeed config its line would use
    zero = next(i for label, i in p.choice.options if label.startswith("ZeRO-2:"))
    p.choice.value = zero
    p.export_path.value = str(tmp_path / "ds.json")
    assert p.export() == str(tmp_path / "ds.json")
    import json

    cfg = json.loads((tmp_path / "ds.json").read_text())
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"] == {"enabled": True}
    # smaller micro-batch and more memory change the ranking: DDP fits a 124M model
    p.model.value = "GPT-2 small (124M)"
    assert p.choice.options[0][0].startswith("DDP: %%distributed ddp")
    p.apply()  # and %%distributed accepts and runs the line the picker wrote
    res = ip.run_cell(shell.next.replace("# your training cell", "_applied = strategy.name  #"))
    assert res.success, res.error_in_exec
    ip.run_line_magic("dist_pull", "_applied --rank 0")
    assert ip.user_ns["_applied"] == "ddp"


ACT_CELL = """%%distributed ddp {precision}--quiet --no-metrics
m = TinyTransformer(vocab={V}, dim={h}, heads={a}, layers={L}, seq={s})
model, opt = strategy.prepare(m, torch.optim.AdamW(m.parameters()))
x = torch.randint(0, {V}, ({b}, {s})); y = torch.randint(0, {V}, ({b}, {s}))
_saved = {{}}
def _pack(t):
    _saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(_pack, lambda t: t):
    loss = lm_loss(model(x), y)
strategy.backward(loss); opt.step()
_act = dict(saved=sum(_saved.values()), ledger=strategy.memory_ledger())
"""


@pytest.mark.parametrize("s,b,h,L,a,V", [(64, 8, 128, 4, 4, 256), (256, 2, 128, 2, 8, 128)])
def test_predicted_peak_with_activations_close_to_measured(ip, cluster, s, b, h, L, a, V):
    """Activations: Korthikanti's count (16-bit, dropout masks) vs bytes PyTorch saves for backward
    on CPU ranks in fp32: measured within -25% / +50% of predicted; model states exact."""
    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell(ACT_CELL.format(s=s, b=b, h=h, L=L, a=a, V=V, precision="")).raise_error()
    ip.run_line_magic("dist_pull", "_act --rank 0")
    got = ip.user_ns["_act"]
    shape = ModelShape.from_module(TinyTransformer(vocab=V, dim=h, heads=a, layers=L, seq=s), seq=s)
    e = estimate("ddp", shape, Training(micro_batch=b, seq=s, precision="fp32"), HARDWARE_PRESETS["2 CPU ranks (gloo)"])
    assert 0.75 <= got["saved"] / e.device["activations"] <= 1.5
    led = got["ledger"]
    predicted = _model_states(e) + e.device["activations"]
    measured = led.params + led.grads + led.master_params + led.optimizer_state + led.other + got["saved"]
    assert 0.75 <= measured / predicted <= 1.5


def test_link_seconds_take_out_the_queue_and_the_last_rank_to_issue():
    """DDP's buckets are in flight together: the second one's issue-to-completion time also holds the
    first one's time on the link, and a collective cannot start before its last rank issues it.
    link_seconds counts each from the later of both to its end, as the link fit needs."""
    from nbtool.metrics import CommRecord, RunRecords
    from nbtool.plan.versus import link_seconds

    def rec(rank, seq, size, t, seconds):
        return CommRecord(rank, seq, "all_reduce", size, size, 2, "float32", t, seconds, "wall", 0, asynchronous=True)

    run = RunRecords("r", "ddp", 2, 0.0)
    run.comms = [rec(0, 1, 1000, 10.0, 0.003), rec(0, 2, 2000, 10.0, 0.008),  # both issued at once on rank 0
                 rec(1, 1, 1000, 10.001, 0.002), rec(1, 2, 2000, 10.0, 0.008),  # rank 1 issues the first 1 ms late
                 rec(0, 3, 500, 10.020, 0.001)]  # later, alone on the link
    times = link_seconds(run)
    assert times[1000] == [pytest.approx(0.002)]  # from rank 1's issue at 10.001 to 10.003
    assert times[2000] == [pytest.approx(0.005)]  # from the first one's end at 10.003 to 10.008
    assert times[500] == [pytest.approx(0.001)]  # nothing ahead of it: its own time


def test_collectives_are_counted_per_op_as_the_strategies_issue_them():
    """Each op's count is what the strategy issues a step (measured with the recorder on 2 CPU ranks):
    FSDP one reduce-scatter and two all-gathers per unit (a unit per block and the root's), ZeRO-3 one
    all-gather per parameter tensor (its fetches, on their own link) and one scalar all-reduce; the time
    is count x alpha + bytes / B on each op's own link."""
    from nbtool.plan.cpu_costs import COLLECTIVES
    from nbtool.plan.estimate import ZERO3_FETCH

    hw = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    numels = (128,) * 38 + (16384,) * 16 + (65536,) * 8
    m = ModelShape(sum(numels), layers=4, hidden=128, heads=4, vocab=256, seq=32, numels=numels)
    t = Training(micro_batch=8, seq=32, precision="fp32")
    fsdp = estimate("fsdp", m, t, hw)
    counts = {c.op: c.count for c in fsdp.comms}
    assert counts == {"reduce_scatter": 5, "all_gather": 10}
    zero3 = estimate("zero3", m, t, hw)
    fetch = next(c for c in zero3.comms if c.op == "all_gather")
    assert fetch.count == len(numels) and fetch.link == ZERO3_FETCH
    assert sum(c.bus_bytes for c in zero3.comms) == pytest.approx(zero3.comm_bus_bytes)
    alpha, bw = COLLECTIVES[ZERO3_FETCH]
    assert zero3.comm_s_by_op(hw)["all_gather"] == pytest.approx(len(numels) * alpha + fetch.bus_bytes / bw)
    assert zero3.comm_s == pytest.approx(sum(zero3.comm_s_by_op(hw).values()))
    rs = HARDWARE_PRESETS["2 CPU ranks (gloo)"].bandwidth(2, "reduce_scatter")
    assert rs == COLLECTIVES["reduce_scatter"] and rs != hw.bandwidth(2)  # gloo's reduce-scatter: its own


def test_in_compute_collectives_wait_for_the_other_rank_on_cpu_ranks_only():
    """tp's all-reduces and pp's sends and receives block inside forward and backward: on CPU ranks each
    also waits out the other rank's host jitter, SYNC_WAIT x compute a step on top of the link (measured
    0.13-0.27 for tp; the table alone put tp 2x short on every shape); data parallelism and GPU ranks
    carry no such term. The per-op figure, the total and the exposed time all hold it."""
    from nbtool.plan.cpu_costs import SYNC_WAIT
    from nbtool.plan.estimate import P2P

    cpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    numels = (128,) * 38 + (16384,) * 16 + (65536,) * 8
    m = ModelShape(sum(numels), layers=4, hidden=128, heads=4, vocab=256, seq=32, numels=numels)
    t = Training(micro_batch=8, seq=32, precision="fp32", grad_accum=4)
    for layout, sizes, op in (("tp", {"tp": 2, "sp": False}, "all_reduce"), ("pp", {"pp": 2}, P2P)):
        e = estimate(layout, m, t, cpu, **sizes)
        link = sum(cpu.collective_s(c.link or c.op, c.group, c.count, c.bus_bytes, fallback=c.op) for c in e.comms)
        assert sum(c.wait_s for c in e.comms) == pytest.approx(SYNC_WAIT[layout] * e.compute_s)
        assert e.comm_s == pytest.approx(link + SYNC_WAIT[layout] * e.compute_s)
        assert e.exposed_comm_s == pytest.approx(e.comm_s)
        mine = next(c for c in e.comms if c.op == op)
        own = cpu.collective_s(op, 2, mine.count, mine.bus_bytes, fallback=op)
        assert e.comm_s_by_op(cpu)[op] == pytest.approx(own + SYNC_WAIT[layout] * e.compute_s)
        gpu = estimate(layout, m, t, HARDWARE_PRESETS["8x H100-80GB NVLink"], **sizes)
        assert all(c.wait_s == 0 for c in gpu.comms)
    assert all(c.wait_s == 0 for c in estimate("fsdp", m, t, cpu).comms + estimate("ddp", m, t, cpu).comms)


def test_the_pipeline_bubble_is_theorys_fraction_of_the_step_and_sends_keep_their_own_link():
    """Theory's (p-1)/(m+p-1) is of the step, compute and idle together: the idle is (p-1) micro-batches'
    work, compute x (p-1)/m (compute x the fraction had put PP 4 with one micro-batch at a quarter of its
    bubble). On CPU ranks a pipeline's sends and receives take their own row of cpu_costs.COLLECTIVES:
    a calibration run's generic link, fitted on other ops, leaves them as they are."""
    from dataclasses import replace

    from nbtool.plan.cpu_costs import COLLECTIVES
    from nbtool.plan.estimate import P2P
    from nbtool.spec import bubble_fraction

    # equal stages (the slowest stage's wait: test_a_pipelines_slowest_stage_sets_its_pace)
    m = replace(ModelShape.transformer(8, 256, 4, 1000, 64), ends=())
    for hw in (HARDWARE_PRESETS["8x H100-80GB NVLink"], HARDWARE_PRESETS["2 CPU ranks (gloo)"]):
        for pp, micro in ((2, 4), (4, 1), (4, 8)):
            e = estimate("pp", m, Training(micro_batch=1, seq=64, grad_accum=micro), hw.with_devices(pp), pp=pp)
            assert e.bubble_s == pytest.approx(e.compute_s * (pp - 1) / micro)
            assert e.bubble_s / (e.compute_s + e.bubble_s) == pytest.approx(bubble_fraction(pp, micro))
    cpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    t = Training(micro_batch=2, seq=64, grad_accum=4)
    e = estimate("pp", m, t, cpu, pp=2)
    sends = next(c for c in e.comms if c.op == P2P)
    alpha, bw = COLLECTIVES[P2P]
    assert cpu.collective_s(P2P, 2, sends.count, sends.bus_bytes) == pytest.approx(
        sends.count * alpha + sends.bus_bytes / bw)
    slow = replace(cpu, intra_latency=3e-3, intra_bw=0.1e9)  # as an FSDP run's blocked gathers can fit it
    assert estimate("pp", m, t, slow, pp=2).comm_s_by_op(slow)[P2P] == pytest.approx(e.comm_s_by_op(cpu)[P2P])


def test_a_pipelines_host_work_grows_with_its_micro_batches_on_cpu_ranks_only():
    """A stage runs its tensors' forward and backward, and the schedule its own work, once per micro-batch:
    on CPU ranks, with the batch fixed, 8 micro-batches took 1.54-1.64x the time outside communication of
    4 (three shapes), which one cost per tensor had left flat. GPU ranks' compute stays the FLOPs'."""
    from nbtool.plan import cpu_costs

    m = ModelShape.transformer(4, 128, 4, 256, 32)
    m = ModelShape(m.params, 4, 128, 4, 256, 32, numels=(128,) * 38 + (16384,) * 16 + (65536,) * 8)
    cpu, gpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"], HARDWARE_PRESETS["8x H100-80GB NVLink"].with_devices(2)
    by_micro = {k: Training(micro_batch=8 // k, seq=32, grad_accum=k) for k in (2, 4, 8)}
    c = {k: estimate("pp", m, t, cpu, pp=2).compute_s for k, t in by_micro.items()}
    per = cpu_costs.S_PER_TENSOR_MICROBATCH["pp"] * len(m.numels) / 2 + cpu_costs.S_PER_MICROBATCH["pp"]
    assert c[8] - c[4] == pytest.approx(4 * per) and c[4] - c[2] == pytest.approx(2 * per) and per > 0
    g = {k: estimate("pp", m, t, gpu, pp=2).compute_s for k, t in by_micro.items()}
    assert g[2] == pytest.approx(g[4]) == pytest.approx(g[8])
    assert estimate("ddp", m, by_micro[8], cpu).compute_s == pytest.approx(estimate("ddp", m, by_micro[2], cpu).compute_s)
    # and the schedule's work once per stage a rank runs, and a third time for the zero bubble schedules'
    # weight gradients: two stages per rank had been predicted at one's cost (interleaved 1F1B measured
    # 7.5 ms more than 1F1B's 21.0 outside the idle time, ZB-V 16.1 ms more, at 4 micro-batches)
    t = by_micro[4]
    one = estimate("pp", m, t, cpu, pp=2).compute_s
    stage = cpu_costs.S_PER_MICROBATCH["pp"] * 4 * cpu.host_speed
    for schedule, more in (("interleaved-1f1b", 1.0), ("interleaved-zb", 2.0), ("zbv", 2.0)):
        got = estimate("pp", m, t, cpu, pp=2, schedule=schedule, virtual=2).compute_s
        assert got == pytest.approx(one + more * stage), schedule
    assert estimate("pp", m, t, gpu, pp=2, schedule="zbv", virtual=2).compute_s == pytest.approx(g[4])


def test_interleaved_1f1b_holds_more_activations_on_its_first_rank():
    """torch's ScheduleInterleaved1F1B runs (V-1) p + 2 (p-1) forward chunks of L/(pV) layers before rank
    0's first backward, and one more in its steady state: 1 + (p-1)/(pV) of 1F1B's L layers' worth
    (Megatron's figure). The planner had given it 1F1B's, 12-13% short of the peak measured on 3 shapes."""
    from nbtool.plan.estimate import activations
    from nbtool.spec import first_rank_held

    assert first_rank_held(2, 2, 4, "interleaved-1f1b") == 1.25 and first_rank_held(4, 2, 8, "interleaved-1f1b") == 1.375
    assert first_rank_held(2, 2, 4, "zbv") == first_rank_held(2, 1, 4, "1f1b") == 1.0
    assert first_rank_held(2, 2, 1, "interleaved-1f1b") == 1.0  # few micro-batches: never below 1F1B's
    m = ModelShape.transformer(4, 128, 4, 256, 32)
    t = Training(micro_batch=2, seq=32, grad_accum=4, precision="fp32")
    cpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    one, two = (estimate("pp", m, t, cpu, pp=2, schedule=s, virtual=v).device["activations"]
                for s, v in (("1f1b", 1), ("interleaved-1f1b", 2)))
    assert one == activations(m, t, 1, 2) and two == activations(m, t, 1, 2, held=1.25) > one
    head = activations(m, t, 1, 2, held=0.0)  # the loss's logits, on the last stage, whatever the schedule
    assert two - head == pytest.approx(1.25 * (one - head))


def test_sequence_parallelism_gathers_and_scatters_what_tp_all_reduces():
    """Under --sp each of tp's all-reduces becomes a reduce-scatter and an all-gather (4 of each a layer
    a micro-batch, the same bus bytes), plus two all-gathers (the first block's input gradient, the
    last block's output) and one fp32 all-reduce a step of the norms' partial gradients: the recorder's
    bytes exactly on 4 shapes (they had been 2-11% short, counted as tp's all-reduces). On CPU ranks
    they carry DTensor's host work per collective and no SYNC_WAIT (their links' fit holds the wait), and
    their gathers and scatters take rows of their own (fitted on tp --sp runs: FSDP's parameter gathers'
    rows had put them 15-25% over); elsewhere the op's link."""
    from nbtool.plan.cpu_costs import COLLECTIVES, S_PER_SP_COLLECTIVE
    from nbtool.plan.estimate import SP_GATHER, SP_SCATTER

    cpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    numels = (128,) * 38 + (16384,) * 16 + (65536,) * 8
    L, h, s, b, accum = 4, 128, 32, 8, 3
    t = Training(micro_batch=b, seq=s, precision="fp32", grad_accum=accum)
    act = s * b * h * 4 / 2  # one fp32 s*b*h activation's bus bytes over 2 ranks
    for gated, norm in ((None, 2 * h), (344, h)):  # LayerNorm: weight and bias; RMSNorm: weight
        m = ModelShape(sum(numels), layers=L, hidden=h, heads=4, vocab=256, seq=s, numels=numels, gated_mlp=gated)
        tp = estimate("tp", m, t, cpu, tp=2, sp=False)
        sp = estimate("tp", m, t, cpu, tp=2)
        ops = {c.op: (c.count, c.bus_bytes) for c in sp.comms if c.group == 2}
        assert ops == {"all_gather": ((4 * L + 2) * accum, (4 * L + 2) * accum * act),
                       "reduce_scatter": (4 * L * accum, 4 * L * accum * act),
                       "all_reduce": (1, 2 * L * norm * 4 * 2 / 2)}
        assert [(c.op, c.count) for c in tp.comms if c.group == 2] == [("all_reduce", 4 * L * accum)]
        assert sp.comm_bus_bytes == pytest.approx(tp.comm_bus_bytes + 2 * accum * act + 2 * L * norm * 4)
        assert all(c.wait_s == 0 for c in sp.comms) and any(c.wait_s > 0 for c in tp.comms)
        assert sp.compute_s - tp.compute_s == pytest.approx(S_PER_SP_COLLECTIVE * (8 * L + 2) * accum)
        by_op = sp.comm_s_by_op(cpu)
        for op, row in (("all_gather", SP_GATHER), ("reduce_scatter", SP_SCATTER)):
            (c,) = [c for c in sp.comms if c.op == op]
            alpha, bw = COLLECTIVES[row]
            assert c.link == row and by_op[op] == pytest.approx(c.count * alpha + c.bus_bytes / bw)
        # a calibration run's own (FSDP) gathers and scatters leave sequence parallelism's alone
        slow = cpu.with_op_links({"all_gather": (0.1, 1e6), "reduce_scatter": (0.1, 1e6)})
        assert estimate("tp", m, t, slow, tp=2).comm_s == pytest.approx(sp.comm_s)
        gpu = HARDWARE_PRESETS["8x H100-80GB NVLink"]
        assert estimate("tp", m, t, gpu, tp=2).compute_s == estimate("tp", m, t, gpu, tp=2, sp=False).compute_s
        on_gpu = estimate("tp", m, t, gpu, tp=2)
        for op in ("all_gather", "reduce_scatter"):
            (c,) = [c for c in on_gpu.comms if c.op == op]
            assert on_gpu.comm_s_by_op(gpu)[op] == pytest.approx(gpu.collective_s(op, 2, c.count, c.bus_bytes))


def test_ddp_buckets_as_torch_makes_them():
    """torch's default buckets cap the first at 1 MiB (backward's first gradients leave early) and the
    rest at 25 MiB; --bucket-mb caps them all (measured: 2 all-reduces a step for 1.5-15 MB of fp32
    gradients under the default). On CPU ranks their time is their own row, in flight while backward
    runs; elsewhere the all-reduce's link."""
    from nbtool.plan.cpu_costs import COLLECTIVES
    from nbtool.plan.estimate import ddp_buckets

    assert [ddp_buckets(b) for b in (2**19, 2**20, 1.5e6, 15e6, 2**20 + 25 * 2**20, 27 * 2**20)] == [1, 1, 2, 2, 2, 3]
    assert [ddp_buckets(15e6, c) for c in (16 * 2**20, 2**20, 0.05 * 2**20)] == [1, 15, 287]
    m = ModelShape(3_760_000, layers=2, hidden=384, heads=6, vocab=256, seq=32)
    t = Training(micro_batch=8, seq=32, precision="fp32")
    cpu, gpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"], HARDWARE_PRESETS["8x H100-80GB NVLink"]
    e = estimate("ddp", m, t, cpu)
    (comm,) = e.comms
    assert (comm.op, comm.link, comm.count) == ("all_reduce", DDP_INFLIGHT, 2)
    alpha, bw = COLLECTIVES[DDP_INFLIGHT]
    assert e.comm_s == pytest.approx(2 * alpha + comm.bus_bytes / bw)
    assert estimate("ddp", m, t, cpu, ddp_bucket=16 * 2**20).comms[0].count == 1
    on_gpu = estimate("ddp", m, t, gpu)
    assert on_gpu.comm_s == pytest.approx(gpu.collective_s("all_reduce", 8, 2, on_gpu.comms[0].bus_bytes))


def test_calibration_fits_an_op_its_run_timed_in_enough_sizes():
    """A run's blocking collectives of one op in 3 sizes spanning 4x give that op's link; an op timed in
    fewer sizes keeps the base's (two sizes of one op do not tell latency from bandwidth in training)."""
    from nbtool.metrics import CommRecord, RunRecords
    from nbtool.plan.cpu_costs import COLLECTIVES
    from nbtool.plan.versus import calibrate

    run = RunRecords("r", "fsdp", 2, 0.0)
    t, seq = 10.0, 0
    for size in (1e5, 4e5, 1.6e6) * 3:
        for rank in (0, 1):
            run.comms.append(CommRecord(rank, seq, "all_gather", int(size), size, 2, "float32", t,
                                        700e-6 + size / 2e9, "wall", 1))
            run.comms.append(CommRecord(rank, seq + 1, "reduce_scatter", int(size), size if size < 1e6 else 4e5, 2,
                                        "float32", t + 0.01, 5e-3, "wall", 1))
        t, seq = t + 0.02, seq + 2
    hw = calibrate(run)
    assert hw.bandwidth(2, "all_gather") == pytest.approx((700e-6, 2e9), rel=1e-6)
    assert hw.bandwidth(2, "reduce_scatter") == COLLECTIVES["reduce_scatter"]  # 2 sizes: the CPU table's
    assert "all_gather (alpha 700 us, B 2.00 GB/s)" in hw.name and hw.measured


@pytest.mark.parametrize("s,b,h,L,a,V", [(64, 8, 128, 4, 4, 256), (128, 4, 256, 2, 4, 1024)])
def test_autocast_activations_equal_what_autograd_saves(ip, cluster, s, b, h, L, a, V):
    """ddp --precision bf16 runs torch.autocast over fp32 weights: autograd saves a bf16 copy of every
    matmul weight, both norms' fp32 inputs and one bf16 copy of the norm's output per q/k/v projection.
    The planner's activations less backward's two loss gradients (8 s b V, not saved tensors) equal the
    bytes saved in a real run within 5% (Korthikanti's pure-bf16 count alone was 25-35% short)."""
    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell(ACT_CELL.format(s=s, b=b, h=h, L=L, a=a, V=V, precision="--precision bf16 ")).raise_error()
    ip.run_line_magic("dist_pull", "_act --rank 0")
    saved = ip.user_ns["_act"]["saved"]
    shape = ModelShape.from_module(TinyTransformer(vocab=V, dim=h, heads=a, layers=L, seq=s), seq=s)
    t = Training(micro_batch=b, seq=s, precision="bf16")
    assert saved / (activations(shape, t, autocast=True) - 8 * s * b * V) == pytest.approx(1, abs=0.05)
    pure = activations(shape, t) - 8 * s * b * V  # the same model in bf16 weights: no copies, bf16 norms
    assert saved / pure > 1.25


def test_peak_is_the_larger_of_backward_start_and_the_optimizer_step():
    """Gradients are None until backward makes them (zero_grad sets them to None): at backward's start
    a DDP device holds activations but no gradients, at the optimizer step gradients but no activations
    (and on GPUs foreach Adam's temporary, one fp32 copy of the parameters); the peak is the larger,
    with what it holds. Model states stay what the device owns over the step."""
    hw = HARDWARE_PRESETS["8x H100-80GB NVLink"]
    big = estimate("ddp", ModelShape.transformer(8, 1024, 16, 8192, 512), Training(micro_batch=8, seq=512), hw)
    assert big.peak_phase == "backward start" and "grads" not in big.device and big.states["grads"] > 0
    assert big.device["activations"] == activations(ModelShape.transformer(8, 1024, 16, 8192, 512),
                                                    Training(micro_batch=8, seq=512), autocast=True)
    assert big.device_total == pytest.approx(sum(big.states.values()) - big.states["grads"]
                                             + big.device["buffers"] + big.device["activations"] + hw.workspace)
    small = estimate("ddp", ModelShape.transformer(8, 1024, 16, 8192, 512), Training(micro_batch=1, seq=16), hw)
    assert small.peak_phase == "optimizer step" and "activations" not in small.device
    assert small.device["grads"] == small.states["grads"]
    assert small.device["buffers"] == small.states["grads"] + small.states["optimizer"] / 2  # bucket + foreach temp
    accumulating = estimate("ddp", ModelShape.transformer(8, 1024, 16, 8192, 512),
                            Training(micro_batch=8, seq=512, grad_accum=4), hw)
    assert accumulating.device["grads"] > 0  # earlier micro-batches' gradients are there as backward starts
    assert _model_states(big) == _model_states(small) == _model_states(accumulating)
    # CPU ranks: torch's Adam runs one tensor at a time there (no foreach): the largest tensor's square
    # root and quotient are what the step adds (measured in a tp step's peak)
    m = ModelShape.from_module(TinyTransformer(vocab=256, dim=384, heads=6, layers=2, seq=32), seq=32)
    cpu = estimate("ddp", m, Training(micro_batch=1, seq=4, precision="fp32"), HARDWARE_PRESETS["2 CPU ranks (gloo)"])
    assert cpu.peak_phase == "optimizer step"
    assert cpu.device["buffers"] == cpu.states["grads"] + 2 * 4 * max(m.numels)


def test_fsdp_peaks_in_the_blocks_backward_at_the_heads_or_at_its_first_reduce_scatter():
    """FSDP (resharding after forward, the root unit too): in the blocks' backward every block's
    activations are alive with two gathered units (three on CPU ranks: gloo gathers into a flat copy)
    and the root unit (embeddings, final norm, head), gathered for the head's backward and kept to the
    end; at the last block's reduce-scatter that block's activations are gone and the next unit is
    prefetched, with the gradients in the reduction dtype (fp32), the output shard and, on CPU ranks,
    gloo's copy of the input. In fp32 with a batch whose activations outweigh a unit the blocks'
    backward is larger; in bf16 (16-bit weights and activations, fp32 reduction) the reduce-scatter
    is (measured on the wide shape: 12 units of bf16 weights alive there). A head 8192 words wide: the
    head's backward, its root unit gathered twice over (the collective's output and the copy out of
    it) after the loss's log_softmax output and first gradient are gone (FSDPMemTracker on CPU ranks:
    49.0 MiB there; counting three units at the loss's backward had put it 24% over)."""
    from nbtool.plan.estimate import _act_per_layer, _block_params, _root_params, activations

    m = ModelShape.from_module(TinyTransformer(vocab=256, dim=384, heads=6, layers=2, seq=32), seq=32)
    unit, root = _block_params(m), _root_params(m)
    assert root == sum(p.numel() for n, p in TinyTransformer(vocab=256, dim=384, heads=6, layers=2, seq=32)
                       .named_parameters() if not n.startswith("blocks."))
    cpu, gpu = HARDWARE_PRESETS["2 CPU ranks (gloo)"], replace(HARDWARE_PRESETS["8x H100-80GB NVLink"], devices_per_node=2)
    fp32 = estimate("fsdp", m, Training(micro_batch=8, seq=32, precision="fp32"), cpu)
    assert fp32.peak_phase == "blocks' backward" and fp32.device["buffers"] == 3 * 4 * unit + 4 * root
    t = Training(micro_batch=8, seq=32, precision="bf16")
    bf16 = estimate("fsdp", m, t, cpu)
    assert bf16.peak_phase == "first reduce-scatter", bf16.device
    # prefetched, fp32 input, its shard, gloo's copy; the root kept
    assert bf16.device["buffers"] == (2 + 4 + 4 / 2 + 4) * unit + 2 * root
    assert bf16.device["activations"] == (m.layers - 1) * _act_per_layer(m, t, 1, False)
    assert "grads" not in bf16.device and _model_states(bf16) == _model_states(fp32)
    on_gpus = estimate("fsdp", m, t, gpu)  # no gloo copies; the bf16 gradients still there while cast
    assert on_gpus.peak_phase == "first reduce-scatter"
    assert on_gpus.device["buffers"] == (2 + 4 + max(2, 4 / 2)) * unit + 2 * root
    assert estimate("fsdp", m, Training(micro_batch=64, seq=32, precision="bf16"), cpu).peak_phase == "blocks' backward"
    # without resharding after forward every unit stays gathered: backward's start
    kept = estimate("fsdp-grad-op", m, t, cpu)
    assert kept.peak_phase == "backward start"
    wide_head = ModelShape.from_module(TinyTransformer(vocab=8192, dim=128, heads=4, layers=4, seq=32), seq=32)
    t = Training(micro_batch=8, seq=32, precision="fp32")
    head = estimate("fsdp", wide_head, t, cpu)
    assert head.peak_phase == "head's backward" and head.device["buffers"] == 2 * 4 * _root_params(wide_head)
    assert head.device["activations"] == activations(wide_head, t) - 8 * 32 * 8 * 8192


def test_fused_qkv_casts_the_norm_output_once_under_autocast():
    """nanoGPT's c_attn (one 3h x h matrix) casts the norm's output once; separate q, k, v projections
    cast it three times: 4 s b h per layer apart."""
    from torch import nn

    class Fused(nn.Module):
        def __init__(self, h, L):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(h, 3 * h, bias=False) for _ in range(L))
            self.emb = nn.Embedding(64, h)

    h, L, s, b = 64, 2, 32, 4
    t = Training(micro_batch=b, seq=s, precision="bf16")
    fused = ModelShape.from_module(Fused(h, L), seq=s)
    separate = ModelShape(fused.params, layers=L, hidden=h, heads=4, vocab=64, seq=s)
    fused = ModelShape(fused.params, layers=L, hidden=h, heads=4, vocab=64, seq=s, numels=fused.numels)
    gap = activations(separate, t, autocast=True) - activations(fused, t, autocast=True)
    assert gap == pytest.approx(L * 4 * s * b * h)
    assert activations(separate, t) == activations(fused, t)  # without autocast no casts at all


def test_tensor_parallel_activations_follow_whether_the_run_used_sequence_parallelism():
    """Korthikanti's table 2: t-way tp keeps s b h (10 + 24/t) per layer (16-bit, fused attention),
    with sequence parallelism s b h 34 / t, except that DTensor keeps the gathered inputs of q/k/v and
    of the MLP's first matrix whole (4 s b h: measured, with them the count equals autograd's saved
    bytes within 0.5% for a Llama, 5% for the tutorial model); a run without --sp is predicted without it."""
    m = ModelShape(10**6, layers=4, hidden=128, heads=4, vocab=256, seq=32)
    t = Training(micro_batch=8, seq=32, precision="bf16")
    hw = HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    sbh = 32 * 8 * 128
    head = 32 * 8 * 256 * 12  # the head stays replicated: whole logits on each tp rank
    # autocast over fp32 weights (tp's bf16): fp32 norm inputs and per-projection casts, 8 s b h a layer
    # (split by sp), and each tp rank's share of the 16-bit weight copies
    weights = 2 * (10**6 - 256 * 128) / 2
    with_sp = estimate("tp", m, t, hw, tp=2).device["activations"]
    without = estimate("tp", m, t, hw, tp=2, sp=False).device["activations"]
    final_norm = sbh * (4 + 2)  # the final LayerNorm's fp32 input, its output cast for the head
    assert with_sp == pytest.approx(4 * sbh * ((30 + 8) / 2 + 4) + head + weights + final_norm)
    assert without == pytest.approx(4 * sbh * (10 + 24 / 2 + 8) + head + weights + final_norm)
    # fp32 without dropout (the tutorial model, GPT-2 at p=0): what autograd held as backward started,
    # listed allocation by allocation on CPU ranks at tp=2: 40 s b h a layer, 36 with sp, and the
    # final LayerNorm's input and output (8 s b h; its input gathered under sp); no 1-byte masks
    t = Training(micro_batch=8, seq=32, precision="fp32")
    plain = replace(m, dropout=False)
    assert estimate("tp", plain, t, hw, tp=2, sp=False).device["activations"] == 4 * 40 * sbh + 8 * sbh + head
    assert estimate("tp", plain, t, hw, tp=2).device["activations"] == 4 * 36 * sbh + 8 * sbh + head
    # with dropout each layer saves two masks of 1 byte an element whatever the precision (split by sp)
    assert (estimate("tp", m, t, hw, tp=2, sp=False).device["activations"]
            - estimate("tp", plain, t, hw, tp=2, sp=False).device["activations"]) == 4 * 2 * sbh
    assert (estimate("tp", m, t, hw, tp=2).device["activations"]
            - estimate("tp", plain, t, hw, tp=2).device["activations"]) == 4 * 2 * sbh / 2
    # GPT-2's k and v, copied into Hugging Face's cache in training too (config.use_cache, its default),
    # saved by SDPA beside the fused qkv output its q views: 2 x 4 bytes s b h a layer, split by tp
    from transformers import GPT2Config

    config = GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=256, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    cached = ModelShape.from_config(config, seq=32)
    assert cached.cache_kv and not cached.dropout and cached.mlp_extra == 3
    uncached = ModelShape.from_config(GPT2Config(**{**config.to_dict(), "use_cache": False}), seq=32)
    assert not uncached.cache_kv
    assert (activations(cached, t, tp=2, sp=False) - activations(uncached, t, tp=2, sp=False)) == 4 * 2 * 4 * sbh / 2


def _tutorial_runs(ip, lines) -> dict:
    """line -> the run of 6 steps under it, at benchmarks/plan_accuracy.py's tutorial shape (inside
    the range nbtool.plan.cpu_costs was fitted on); a pipeline's through forward_backward."""
    import nbtool

    runs = {}
    for line in lines:
        step = "strategy.forward_backward(x, y)" if line.startswith("pp") else "strategy.backward(lm_loss(model(x), y))"
        ip.run_cell(f"""%%distributed {line} --quiet --no-watch
from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
m = TinyTransformer(vocab=256, dim=128, heads=4, layers=4, seq=32)
model, opt = strategy.prepare(m, torch.optim.AdamW(m.parameters()), loss_fn=lm_loss)
for _, (x, y) in zip(range(6), strategy.dataloader(SyntheticTokens(samples=96, seq=32, vocab=256), batch_size=8)):
    {step}; opt.step(); opt.zero_grad()
""").raise_error()
        runs[line] = nbtool.last_run()
    return runs


def test_cpu_ranks_predict_another_strategys_host_cost_from_one_run(ip, cluster):
    """CPU ranks: calibrated on a ddp run, the planner predicts zero3's time outside communication
    through the per-tensor host cost (nbtool.plan.cpu_costs), not ddp's FLOP rate alone (which put it
    at ddp's, 60-80% short); calibrated on a run, that run's own compute is predicted exactly."""
    from nbtool.plan.versus import calibrate, measured_compute_s, versus

    # three ddp, zero3 pairs, taking turns: a stretch of a slow machine had once made one ddp run 2.7x this
    # machine's typical and its zero3 run 1.3x (CI), which one pair cannot tell from a wrong model
    pairs = [_tutorial_runs(ip, ("ddp", "zero3")) for _ in range(3)]
    ratios = []  # (measured zero3 / ddp, predicted / measured zero3) per pair, ddp's run calibrating
    for pair in pairs:
        cal = calibrate(pair["ddp"])
        mine, theirs = (versus(pair[k], cal, k).row("  compute") for k in ("ddp", "zero3"))
        # ZeRO-3's per-parameter fetch and release, in the model: its compute over ddp's (one FLOP rate: 1x)
        assert theirs.predicted > 1.5 * mine.predicted, (theirs, mine)
        ratios.append((theirs.measured / mine.measured, theirs.predicted / theirs.measured))
    # measured 2.1-3.0x ddp's at this shape; a single run here moves by up to 50% from the next: a factor-2
    # band around the prediction, not plan_accuracy's 25%
    assert statistics.median(r for r, _ in ratios) > 1.5, ratios
    assert 0.5 < statistics.median(e for _, e in ratios) < 2.0, ratios
    runs = sorted(pairs, key=lambda pair: measured_compute_s(pair["ddp"]))[1]  # the median ddp run's pair
    hw = calibrate(runs["ddp"])
    assert hw.host_speed is not None and 0.1 < hw.host_speed < 10, hw  # CPU ranks: the host model's speed
    # DDP's bucket all-reduces are all async, sharing the cores with backward: not the link's time, so the
    # link stays the CPU preset's and the name says so; ZeRO-3 blocks on collectives of several sizes
    from nbtool.plan.inputs import HARDWARE_PRESETS

    assert "CPU preset" in hw.name and hw.intra_latency == HARDWARE_PRESETS["2 CPU ranks (gloo)"].intra_latency, hw
    assert calibrate(runs["zero3"]).name.startswith("link (alpha"), calibrate(runs["zero3"]).name
    own = versus(runs["ddp"], hw, "itself").row("  compute")
    assert own.predicted == pytest.approx(own.measured, rel=1e-9)
    zero3 = versus(runs["zero3"], hw, "run 'ddp'").row("  compute")
    # the planner counts ZeRO-3's fetches as DeepSpeed issues them (one all-gather per parameter tensor) and
    # puts each op's blocked time next to its prediction
    fetches = versus(runs["zero3"], hw, "run 'ddp'").row("    all_gather")
    assert fetches.measured > 0 and fetches.predicted > 0 and "the planner counts" not in fetches.note, fetches
    # ZeRO-3's compute is its step less the time blocked on collectives, not less their in-flight union:
    # prefetches are in flight while forward computes (that time had been in neither term)
    from nbtool import run_analysis

    steps = run_analysis.steady_steps(runs["zero3"])
    assert sum(s["comm_s"] > s["exposed_s"] for s in steps) >= len(steps) - 1, steps  # in flight, not blocked
    assert zero3.measured == measured_compute_s(runs["zero3"]) == statistics.median(s["seconds"] - s["exposed_s"]
                                                                                    for s in steps)
    assert "blocked on collectives" in zero3.source, zero3
    # DDP's reducer waits in C++: its compute is the step less the buckets' in-flight union, which the
    # planner gives DDP's buckets (their own row on CPU ranks), counted as torch makes them
    ddp_steps = run_analysis.steady_steps(runs["ddp"])
    assert own.measured == statistics.median(s["compute_s"] for s in ddp_steps) and "comm busy time" in own.source
    ddp = versus(runs["ddp"], hw, "itself").estimate
    assert [(c.link, c.count) for c in ddp.comms] == [(DDP_INFLIGHT, statistics.median(s["count"] for s in ddp_steps))]
    # a step off beyond its tolerance names the term that holds the miss; a host 3x slower than the run's
    # (a calibration caught in a slow spell) puts it in compute, and the note sets the two host speeds side by side
    step = versus(runs["zero3"], hw, "run 'ddp'").row("step time")
    assert (step.note == "") == (step.within is not False), step
    slow = replace(hw, host_speed=3 * hw.host_speed)
    v = versus(runs["zero3"], slow, "run 'ddp'")
    step, compute = v.row("step time"), v.row("  compute")
    assert step.within is False and step.note.startswith("off mostly in compute: +"), step
    assert f" ({compute.error:+.1%}); the whole step +" in step.note and compute.predicted > 2 * compute.measured, step
    (note,) = [n for n in v.notes if "implies a host" in n]
    own = calibrate(runs["zero3"]).host_speed
    assert f"implies a host x{own:.2f} the CPU reference's, where the calibration had x{3 * hw.host_speed:.2f}" in note
    assert own / (3 * hw.host_speed) < 1 / 1.5 and "run both cells again" in note, note
    assert "outside what those ratios were fitted on" not in note  # the tutorial shape is inside the fit
    assert not any("implies a host" in n for n in versus(runs["zero3"], calibrate(runs["zero3"]), "itself").notes)


def test_a_run_calibrated_on_itself_predicts_its_own_compute(ip, cluster):
    """Calibration inverts the planner's whole compute term on CPU ranks: the per-tensor host work, a
    pipeline's per micro-batch, sequence parallelism's per gather and scatter (a tp --sp run calibrated
    on itself had predicted its own compute 44% over: only the per-tensor part had been inverted)."""
    from nbtool.plan.versus import calibrate, versus

    for line, run in _tutorial_runs(ip, ("tp --sp", "pp --microbatches 4", "fsdp --precision bf16")).items():
        row = versus(run, calibrate(run), "itself").row("  compute")
        assert row.predicted == pytest.approx(row.measured, rel=1e-9), (line, row)


def test_collectives_of_close_sizes_keep_the_presets_bandwidth(ip, cluster):
    """An FSDP run without resharding blocks on its units' all-gathers and reduce-scatters, whose sizes
    lie close together: fitted freely they had put B at 15,900 GB/s. On CPU ranks the link keeps the
    preset's B, with the latency that puts it through the run's times, and says so."""
    import nbtool
    from nbtool.plan.inputs import HARDWARE_PRESETS
    from nbtool.plan.versus import LINK_FIT_SPAN, calibrate, link_seconds

    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell("%%distributed fsdp --no-reshard-after-forward --quiet --no-watch\n"
                "_led = _one_step(strategy, steps=4)").raise_error()
    run = nbtool.last_run()
    sizes = sorted(link_seconds(run, blocking_only=True))
    assert len(sizes) >= 2 and sizes[-1] < LINK_FIT_SPAN * sizes[0], sizes
    hw = calibrate(run)
    assert hw.intra_bw == HARDWARE_PRESETS["2 CPU ranks (gloo)"].intra_bw and hw.intra_latency > 0, hw
    assert f"through the CPU preset's B 1.20 GB/s: the run blocked on {len(sizes)} sizes" in hw.name, hw.name
    assert "too close to fit B" in hw.name


def test_a_tiny_models_miss_names_the_range_the_cost_model_was_fitted_on(ip, cluster):
    """A model far smaller than the runs nbtool.plan.cpu_costs was fitted on (its step mostly per-tensor
    host work at sizes the fit did not see): the note beside a compute miss says so, with the range."""
    from nbtool.plan import cpu_costs
    from nbtool.plan.versus import calibrate, versus
    import nbtool

    ip.run_cell(LEDGER_SETUP).raise_error()
    runs = {}
    for line in ("ddp", "zero3"):
        ip.run_cell(f"%%distributed {line} --quiet --no-watch\n_led = _one_step(strategy, steps=4)").raise_error()
        runs[line] = nbtool.last_run()
    hw = calibrate(runs["ddp"])
    v = versus(runs["zero3"], replace(hw, host_speed=3 * hw.host_speed), "run 'ddp'")
    (note,) = [n for n in v.notes if "implies a host" in n]
    lo, hi = cpu_costs.FITTED_GFLOP
    assert "this model's run is outside what those ratios were fitted on: GFLOP " in note, note
    assert f"per rank per step (fitted on {lo:g}-{hi:g})" in note and "if it stays off, it is the model" in note
    # a model inside the fit predicted from the tiny one's calibration: the note names the calibration run's
    # model (a rerun of either cell would not help), not a slow spell
    inside = _tutorial_runs(ip, ("zero3",))["zero3"]
    w = versus(inside, replace(hw, host_speed=3 * hw.host_speed), "run 'ddp'", "ddp", runs["ddp"])
    (theirs,) = [n for n in w.notes if "implies a host" in n]
    assert "the calibration run's model is outside what those ratios were fitted on: GFLOP " in theirs, theirs
    assert "--calibrate-on NAME" in theirs and "machine may have run" not in theirs, theirs
    # %dist_compare's error table marks its step time, and says why below (its rows hold no notes)
    from nbtool.plan.versus import ROUGH, error_cells

    _, cells, below = error_cells([v, versus(runs["ddp"], hw, "this run")])
    assert [row[4].endswith(ROUGH) for row in cells] == [True, True], cells
    assert f"{ROUGH.strip()} a model outside what the CPU ranks' cost model was fitted on ({lo:g}-{hi:g} GFLOP" in below


def test_a_calibration_run_in_a_slow_spell_is_named_beside_the_next_run(ip, cluster, capsys):
    """A real slow spell: six busy processes share the 2 cores while a ddp cell runs, none while the
    zero3 cell after it runs. Predicted from the ddp run's calibration, zero3's step comes out long, the
    step's note puts the miss in compute, and a note sets the host speed zero3's run implies beside the
    calibration's, more than 1.5x apart. The ddp cell run again, ``%dist_plan --vs zero3 --calibrate-on
    ddp`` predicts the same zero3 run from it: shorter, and closer to what was measured."""
    import subprocess
    import sys

    import nbtool
    from nbtool.plan.versus import calibrate, versus

    # each in a session of its own: the kernel shares the CPU between sessions (autogroup), so busy
    # processes in the test's session left the engines' share whole (and, keeping the vCPUs awake, made
    # the ddp run 10-30% faster); four sessions of their own made it 2.8x slower
    # how much slower 6 of them make it varies by host (a CI run's zero3 came out only +24.3%, its compute
    # +61.7%): a spell too mild to put the step beyond the tolerance is made again, harder (at most 3 tries)
    for n_hogs in (6, 10, 14):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(n_hogs)]
        try:
            slow = _tutorial_runs(ip, ("ddp",))["ddp"]
        finally:
            for h in hogs:
                h.kill()
                h.wait(timeout=10)
        zero3 = _tutorial_runs(ip, ("zero3",))["zero3"]
        hw = calibrate(slow)
        v = versus(zero3, hw, "run 'ddp'")
        step = v.row("step time")
        if step.within is False:
            break
    assert step.within is False and step.note.startswith("off mostly in compute: +"), (n_hogs, v.text())
    (note,) = [n for n in v.notes if "implies a host" in n]
    own = calibrate(zero3).host_speed
    assert own / hw.host_speed < 1 / 1.5 and f"where the calibration had x{hw.host_speed:.2f}" in note, note
    # under the cell, with the calibration run's name, the note gives the line below
    (shown,) = [n for n in nbtool.predicted_vs_measured("zero3").notes if "implies a host" in n]
    assert shown.endswith("(or run the 'ddp' cell again, then %dist_plan --vs zero3 --calibrate-on ddp)"), shown
    # what the note says to do: run the ddp cell again, and predict zero3 from it
    _tutorial_runs(ip, ("ddp",))
    capsys.readouterr()
    ip.run_line_magic("dist_plan", "--vs zero3 --calibrate-on ddp")
    out = capsys.readouterr().out
    assert out.startswith("predicted vs measured, run 'zero3'") and "calibrated on run 'ddp'" in out, out
    again = nbtool.predicted_vs_measured("zero3", calibrate_on="ddp")
    assert again.run is zero3 and again.row("step time").measured == step.measured
    assert again.row("step time").predicted < step.predicted, (again.text(), v.text())
    assert abs(again.row("step time").error) < abs(step.error), (again.text(), v.text())
    # every run predicted from the one named, in %dist_compare's error lines, with the run's name
    ip.run_line_magic("dist_compare", "ddp zero3 --calibrate-on ddp")
    errors = capsys.readouterr().out.split("planner's error")[1].splitlines()
    assert errors[0].split()[-2:] == ["calibrated", "on"], errors
    line = next(x for x in errors if x.startswith("zero3 "))
    assert line.endswith("'ddp'") and f"{again.row('step time').error:+.1%}" in line, errors
    ddp_line = next(x for x in errors if x.startswith("ddp "))
    assert ddp_line.endswith("itself"), errors  # calibrated on itself: its compute fits by construction
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="--calibrate-on 'nosuch': no run named 'nosuch'; recorded runs: "):
        ip.run_line_magic("dist_compare", "--calibrate-on nosuch")
    assert capsys.readouterr().out == ""  # refused before anything was shown
    # the ranking, calibrated on a run named: the text says which
    ip.run_line_magic("dist_plan", "--text --model 1e8 --calibrate-on zero3")
    assert "from run 'zero3'" in capsys.readouterr().out


def test_a_step_off_names_the_term_that_holds_the_miss():
    """The step's miss goes to the term of the planner's step that holds more than half of it, with the
    same sign; else each term's share is listed (and, where exposed comm is not observable, the rest)."""
    from nbtool.plan.versus import Row, _step_note

    def rows(step, compute, exposed):
        return [Row("step time", *step, "s", "", 0.25), Row("  compute", *compute, "s", ""),
                Row("  exposed comm", *exposed, "s", "")]

    assert _step_note(rows((0.10, 0.11), (0.05, 0.06), (0.05, 0.05))) == ("", None)  # +10%: within
    assert _step_note(rows((0.10, 0.16), (0.05, 0.055), (0.05, 0.105))) == (
        "off mostly in exposed comm: +55.0 ms (+110.0%); the whole step +60.0 ms", "exposed comm")
    assert _step_note(rows((0.10, 0.06), (0.05, 0.03), (0.05, 0.03))) == (
        "the step's -40.0 ms is spread: compute -20.0 ms, exposed comm -20.0 ms", None)
    ddp = rows((0.10, 0.05), (0.05, 0.04), (None, 0.01))  # DDP: exposed comm not observable
    assert _step_note(ddp) == ("the step's -50.0 ms is spread: compute -10.0 ms (the rest: communication in "
                               "flight, not observable by term here)", None)



def test_zero2_peaks_as_backward_starts_before_its_gradient_partition(ip, cluster):
    """DeepSpeed ZeRO-2 fills its gradient partition as the reduce bucket is reduced, at backward's end
    when the bucket holds every gradient, and lets go of the bucket before the optimizer step: the
    planner's peak is the larger of backward's start (every activation and the bucket, no gradient)
    and the optimizer step (the partition and Adam's temporaries). On real engines, with a bucket that
    just holds the gradients (DeepSpeed's 1.86 GiB default would make the peak), two shapes are within
    5% of the measured peak; adding the partition to backward's start, as the planner did, was over
    by more than 5% on the tutorial shape (8.0-9.3% of the peak beyond the bucket on three shapes)."""
    import nbtool
    from nbtool.plan.versus import calibrate, versus

    for shape, bucket in (("dim=128, heads=4, layers=4", 4), ("dim=384, heads=6, layers=2", 15)):
        ip.run_cell(f"""%%distributed zero2 --reduce-bucket-mb {bucket} --memory-timeline --quiet --no-watch
from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
m = TinyTransformer(vocab=256, {shape}, seq=32)
model, opt = strategy.prepare(m, torch.optim.AdamW(m.parameters()))
for _, (x, y) in zip(range(4), strategy.dataloader(SyntheticTokens(samples=64, seq=32, vocab=256), batch_size=8)):
    strategy.backward(lm_loss(model(x), y)); opt.step(); opt.zero_grad()
""").raise_error()
        run = nbtool.last_run()
        v = versus(run, calibrate(run), "itself")
        peak, e = v.row("peak tensor memory"), v.estimate
        assert e.peak_phase == "backward start" and "grads" not in e.device and e.states["grads"] > 0, e
        # the quieter rank's peak: in one tutorial-shape run of six, one rank's timeline held a block
        # of psi/2 from set-up to the end (every step of that rank only; not found, see README), which
        # is not the moment under test here
        measured = min(max(t.totals()) for t in run.timelines)
        assert abs(peak.predicted / measured - 1) <= 0.05, (shape, peak, measured, e.device)
        if bucket == 4:
            assert (peak.predicted + e.states["grads"]) / measured - 1 > 0.05, (peak, measured, e.states)


def test_zero3_peaks_with_its_gathered_parameters_held_twice_or_at_its_last_reduce_scatter(ip, cluster, tmp_path):
    """DeepSpeed ZeRO-3 gathers a prefetch bucket's shards into one flat buffer and builds each parameter
    from it with torch.cat; the flat buffer lives until backward's end, so every parameter above the
    persistence threshold is held twice while backward runs (measured: 13.5 MiB each on the wide shape).
    Told to fetch them again for backward, unprefetched (stage3_max_reuse_distance and
    stage3_prefetch_bucket_size 0), nothing gathered is left when
    backward ends, and the peak is there: the gradients flattened for the reduce-scatter and gloo's
    clone of them. With a reduce bucket that just holds the gradients (not DeepSpeed's 1.86 GiB default,
    which would make the peak), the planner is within 10% of both; counting the others' shards once, as
    it did, was over 15% short of the first, and leaving out the reduce-scatter 23% of the second."""
    import nbtool
    from nbtool.plan.model_states import PERSISTENCE_THRESHOLD
    from nbtool.plan.versus import calibrate, reduce_bucket_bytes, versus

    config = tmp_path / "refetch.json"
    config.write_text(json.dumps({"zero_optimization": {"stage3_max_reuse_distance": 0,
                                                        "stage3_prefetch_bucket_size": 0}}))
    peaks = {}
    for extra in ("", f" --ds-config {config}"):
        ip.run_cell(f"""%%distributed zero3 --reduce-bucket-mb 15 --memory-timeline --quiet --no-watch{extra}
from nbtool.rank.example_models import TinyTransformer, SyntheticTokens, lm_loss
m = TinyTransformer(vocab=256, dim=384, heads=6, layers=2, seq=32)
model, opt = strategy.prepare(m, torch.optim.AdamW(m.parameters()))
for _, (x, y) in zip(range(4), strategy.dataloader(SyntheticTokens(samples=64, seq=32, vocab=256), batch_size=8)):
    strategy.backward(lm_loss(model(x), y)); opt.step(); opt.zero_grad()
""").raise_error()
        run = nbtool.last_run()
        v = versus(run, calibrate(run), "itself")
        peaks[extra] = (v.row("peak tensor memory"), v.estimate, reduce_bucket_bytes(run), run.description.param_numels)
    (peak, e, bucket, numels), (refetch, e2, _, _) = peaks.values()
    gathered = 4 * sum(k for k in numels if k > PERSISTENCE_THRESHOLD)
    assert gathered > 10 * 2**20 and e.device["buffers"] >= 2 * gathered + bucket and e.peak_phase == "", e.device
    assert abs(peak.predicted / peak.measured - 1) <= 0.10, (peak, e.device)
    assert (peak.predicted - 1.5 * gathered) / peak.measured - 1 < -0.15, (peak, gathered)
    # fetched again: the peak beyond the states and the bucket is two copies of every gradient
    assert e2.peak_phase == "last reduce-scatter" and e2.device["activations"] == 0, e2
    assert abs(refetch.predicted / refetch.measured - 1) <= 0.10, (refetch, e2.device)
    rest = refetch.measured - sum(e2.states.values()) - bucket
    assert 0.9 < rest / (2 * 4 * sum(numels)) < 1.1, (rest, sum(numels))


def test_cpu_ranks_predict_bf16_from_an_fp32_run_and_back(ip, cluster):
    """How fast bf16 computes against fp32 is the CPU's: where it is native the planner's reference fit
    has it 2.5x faster per FLOP; on an AVX2-only CPU it is emulated, and FSDP's bf16 steps took 4.8x the
    fp32 ones' time, so a calibration on an fp32 run predicted a bf16 run's compute 5x short, and one on
    the bf16 run predicted the fp32 run 5x long. The ranks measure the ratio (one Linear's forward and
    backward, nbtool.rank.matmul_probe), the calibration carries it, and each run is predicted from the
    other within a factor 3 at the median of three pairs (a single CPU run moves up to 50% from the next;
    5.6x off without the probe). Where bf16 is emulated its FLOPs are most of a bf16 run's time, so that
    run calibrates bf16's rate in training and keeps the host speed it is given (a 10% miss of the probed
    rate had tripled the host's work: an fp32 run after it predicted +211%): given the fp32 run's, it
    predicts that run's compute exactly, and itself exactly too."""
    from nbtool.plan.versus import calibrate, versus

    # three pairs, taking turns, each direction judged at its median pair: one run caught in a slow spell
    # (CI once had one 2.7x this machine's typical time) would take a single pair out of the band
    pairs = [_tutorial_runs(ip, ("fsdp", "fsdp --precision bf16")) for _ in range(3)]
    fp32, bf16 = pairs[0]["fsdp"], pairs[0]["fsdp --precision bf16"]
    probe = fp32.description.matmul_flops
    assert probe and min(probe) > 0 and bf16.description.matmul_flops == probe  # once per engine
    for base, other in (("fsdp", "fsdp --precision bf16"), ("fsdp --precision bf16", "fsdp")):
        ratios = []
        for pair in pairs:
            hw = calibrate(pair[base])
            assert hw.matmul_flops[0] == probe[0] and " GFLOP/s, x" in hw.name, hw.name
            compute = versus(pair[other], hw, f"run {base!r}").row("  compute")
            ratios.append(compute.predicted / compute.measured)
        assert 1 / 3 < statistics.median(ratios) < 3, (base, ratios, probe)
    emulated = probe[1] < probe[0] / 2
    speed = calibrate(fp32).host_speed
    hw = calibrate(bf16, host_speed=speed)
    assert (hw.host_speed == speed) == emulated and ("kept" in hw.name) == emulated, hw.name
    for run in (fp32, bf16) if emulated else ():
        compute = versus(run, hw, "run 'fsdp'").row("  compute")
        assert compute.predicted == pytest.approx(compute.measured, rel=1e-6), (run.name, compute, hw.name)
    notes = versus(bf16, calibrate(fp32), "run 'fsdp'").notes
    assert any("on this machine fp32 trains faster" in n for n in notes) == (probe[1] < probe[0]), (probe, notes)

def test_the_matmul_probe_keeps_each_dtypes_fastest_round(monkeypatch):
    """One round of the probe caught in a slow spell read bf16 30% slow (2.8-3.1 GFLOP/s against 4.0-4.4):
    fp32 and bf16 rounds in turn, each dtype's fastest kept (the timer stands in for the matmuls)."""
    from nbtool.rank import matmul_probe

    rounds = iter([0.002, 0.040, 0.0021, 0.028, 0.003, 0.029])  # (fp32, bf16) x 3: bf16's first slow
    monkeypatch.setattr(matmul_probe, "_seconds", lambda dtype: next(rounds))
    matmul_probe.matmul_flops.cache_clear()
    try:
        fp32, bf16 = matmul_probe.matmul_flops()
    finally:
        matmul_probe.matmul_flops.cache_clear()
    m, k, n = matmul_probe.SHAPE
    assert (fp32, bf16) == (6 * m * k * n / 0.002, 6 * m * k * n / 0.028)


OWN_LOOPS = """%%distributed {line} --quiet
from nbtool.rank.example_models import TinyTransformer, lm_loss
m = TinyTransformer()
model, opt = strategy.prepare(m, torch.optim.AdamW(m.parameters()), loss_fn=lm_loss)
for _ in range(3):
    x = torch.randint(0, 64, (3, 16))
    {step}
    opt.step(); opt.zero_grad()
"""


@pytest.mark.parametrize("step", ["strategy.backward(lm_loss(model(x), x))", "strategy.forward_backward(x, x)"])
def test_a_loop_with_its_own_data_gives_the_planner_its_batch(ip, cluster, capsys, step):
    """Without strategy.dataloader the batch is seen at forward_backward or the model's first forward:
    the planner counts the run's tokens, so a run calibrated on itself fits its compute time (it had
    assumed 2048 tokens a sample in the prediction and 1 in the calibration: +2751% on a GPT-2)."""
    import nbtool
    from nbtool.plan.versus import calibrate, versus

    ip.run_cell(OWN_LOOPS.format(line="ddp", step=step)).raise_error()
    run = nbtool.last_run()
    assert run.description.batch == {"samples": 3, "tokens": 48, "seq": 16}
    v = versus(run, calibrate(run), "this run")
    compute = v.row("  compute")
    assert compute.predicted == pytest.approx(compute.measured, rel=1e-6)
    assert v.row("throughput").measured > 0
    assert not any("sequence length not given" in n for n in v.notes)


def test_overlap_comm_double_buffers_the_zero12_reduce_bucket(ip, cluster):
    """ZeRO-1/2 with --overlap-comm allocate a second reduce bucket (5e8 elements: 1.86 GiB in fp32);
    ZeRO-3's own buckets do not change. A real run's peak tensors agree within the 10% tolerance
    (it was -50% with one bucket predicted)."""
    import nbtool

    m, t, hw = ModelShape.from_module(TinyTransformer()), Training(precision="fp32"), HARDWARE_PRESETS["2 CPU ranks (gloo)"]
    for layout in ("zero1", "zero2"):
        assert (estimate(layout, m, t, hw, overlap_comm=True).device_total
                - estimate(layout, m, t, hw).device_total) == REDUCE_BUCKET * 4
    assert estimate("zero3", m, t, hw, overlap_comm=True).device_total == estimate("zero3", m, t, hw).device_total
    ip.run_cell(LEDGER_SETUP).raise_error()
    ip.run_cell("%%distributed zero2 --overlap-comm --memory-timeline --quiet\n"
                "_led = _one_step(strategy, steps=2)").raise_error()
    peak = nbtool.predicted_vs_measured().row("peak tensor memory")
    assert peak.measured > 2 * REDUCE_BUCKET * 4 and peak.within, peak


def test_advice_followed_says_how_much_of_the_predicted_change_came():
    """Running a suggested line is "as predicted" only when at least half the predicted change came, the
    predicted way: a pipeline bubble that fell from 31% to 30% against 11% predicted is not."""
    from nbtool.plan.advice import verdict

    assert verdict(0.31, 0.30, 0.11) == "the predicted way, 5% of the predicted change"
    assert verdict(0.31, 0.15, 0.11) == "as predicted"
    assert verdict(0.31, 0.35, 0.11) == "not as predicted"
    assert verdict(5.0, 4.0, 4.0) == "as predicted" and verdict(5.0, None, 4.0) == "not as predicted"
    assert verdict(5.0, 5.0, 5.0) == "as predicted"

