"""What the planner is told: the model's shape, the training setup, the hardware.

Pure Python. Bandwidth defaults are bus bandwidths as nccl-tests reports them
(busbw of a large all_reduce), so they plug into the alpha-beta model
t = alpha + factor * S / B; measured numbers from ``%commbench`` replace them
via ``Hardware.with_commbench``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .cpu_costs import COLLECTIVES

GB = 1e9
GiB = 2**30
MiB = 2**20


def format_gb(x: float) -> str:
    """The planner's bytes: decimal, one decimal, 13.2 GB; below 0.1 GB in MB, below 0.1 MB in KB
    (a small model's figures are not 0.0 GB)."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= 0.1 * size or unit == "KB":
            return f"{x / size:.1f} {unit}"


def format_count(n: float) -> str:
    """A parameter count as people write it: 8.03B, 436K, 512."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def format_ms(seconds: float) -> str:
    """The planner's times in ms: whole from 10 ms, one decimal from 1 ms, two significant figures below
    (a tiny model's step on a GPU is 0.031 ms, not 0)."""
    ms = seconds * 1e3
    if ms >= 10 or ms == 0:
        return f"{ms:.0f}"
    return f"{ms:.1f}" if ms >= 1 else f"{ms:.2g}"


# attention modules' head counts (ours, torch's MultiheadAttention, GPT-2's, nanoGPT's); a model with a
# config (Hugging Face's Llama family keeps none on its modules) says it there
_HEAD_ATTRS = ("heads", "num_heads", "n_head")


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it.

    ``params`` always; the transformer shape (layers, hidden, heads, vocab,
    seq) when known, for activations and tensor/pipeline layouts;
    ``largest_layer`` (parameters of the biggest single module) for gather
    buffers; ``gated_mlp`` and ``kv_heads`` for a Llama-style decoder's
    activations; ``numels`` (every parameter tensor's size) when counted from a
    module, which makes the ZeRO-3 partition and padding figures exact.
    """

    params: int
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    seq: int | None = None
    largest_layer: int | None = None
    numels: tuple = field(default=(), compare=False)
    name: str = ""
    gated_mlp: int | None = None  # a gated MLP's width (gate, up, down: the Llama family); None: GPT's 4h MLP
    kv_heads: int | None = None  # grouped-query attention's key/value heads (None: as many as the query heads)
    # 4h-wide tensors a GPT MLP's activation saves beyond GeLU's input: Hugging Face's NewGELUActivation
    # (GPT-2's gelu_new, tanh written as elementwise ops) keeps its tanh, 0.5 x and 1 + tanh too
    mlp_extra: int = 0
    # dropout layers with p > 0 (counted modules; Korthikanti's GPT count assumes them): each saves a
    # 1-byte mask for backward (GPT's two per layer)
    dropout: bool = True
    # Hugging Face's models with config.use_cache (its default) concatenate each layer's k and v into a
    # DynamicCache in training too: copies that SDPA saves (beyond the fused qkv output its q still views)
    cache_kv: bool = False
    # (before, after, shared): the element counts of the parameters a pipeline's first stage keeps besides
    # its blocks (embeddings), of those its last keeps (final norm, head), and of those in both (a head
    # tied to the embedding: one tensor where one rank runs both ends, as under ZB-V); () when unknown
    ends: tuple = field(default=(), compare=False)

    @classmethod
    def transformer(cls, layers: int, hidden: int, heads: int, vocab: int, seq: int, name: str = "") -> "ModelShape":
        """GPT-style decoder: 12 L h^2 + 13 L h + (V + s) h parameters (Narayanan et al. 2021, eq. 2)."""
        params = 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden
        return cls(params, layers, hidden, heads, vocab, seq, largest_layer=max(vocab * hidden, 4 * hidden**2),
                   name=name or f"{layers}L-{hidden}h transformer",
                   ends=((vocab * hidden, seq * hidden), (vocab * hidden,), (vocab * hidden,)))  # the head tied

    @classmethod
    def decoder(cls, layers: int, hidden: int, heads: int, vocab: int, seq: int, kv_heads: int | None = None,
                intermediate: int | None = None, tied: bool = False, qkv_bias: bool = False,
                name: str = "") -> "ModelShape":
        """A Llama-style decoder, counted exactly: grouped-query attention (``kv_heads`` key/value heads
        of hidden/heads each), a gated MLP (gate, up, down: 3 h I), RMSNorms (h each, two per layer and
        a final one), rotary positions (no parameters), an untied head unless ``tied``."""
        kv = (kv_heads or heads) * (hidden // heads)
        inter = intermediate or 4 * hidden
        attention = 2 * hidden * hidden + 2 * hidden * kv + ((hidden + 2 * kv) if qkv_bias else 0)
        per_layer = attention + 3 * hidden * inter + 2 * hidden
        params = layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden
        return cls(params, layers, hidden, heads, vocab, seq, largest_layer=max(vocab * hidden, hidden * inter),
                   name=name or f"{layers}L-{hidden}h decoder", gated_mlp=inter, kv_heads=kv_heads or heads,
                   ends=((vocab * hidden,), (hidden, vocab * hidden), (vocab * hidden,) if tied else ()))

    @classmethod
    def from_config(cls, config, seq: int | None = None, name: str = "") -> "ModelShape":
        """Count a Hugging Face config's model exactly: built on the meta device (nothing allocated)."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return cls.from_module(model, seq=seq or getattr(config, "max_position_embeddings", None)
                               or getattr(config, "n_positions", None),
                               name=name or f"{type(model).__name__} ({config.model_type})")

    @classmethod
    def from_module(cls, module, seq: int | None = None, name: str = "") -> "ModelShape":
        """Count a torch module (meta-device modules work: nothing is allocated).

        Finds the largest leaf module, the number of repeated blocks (the
        longest ModuleList) and the parameters before and after them
        (``ends``), and hidden/vocab from the first Embedding.
        """
        from torch import nn

        numels = tuple(p.numel() for p in module.parameters())
        leaves = [sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()]
        lists = [(len(m), name) for name, m in module.named_modules() if isinstance(m, nn.ModuleList)]
        layers, blocks = max(lists, default=(None, None))
        emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
        heads = next((h for m in module.modules() for h in (getattr(m, k, None) for k in _HEAD_ATTRS)
                      if isinstance(h, int) and h > 0), None)
        # a gated MLP by Hugging Face's names (Llama, Qwen2, Mistral): its width is up_proj's
        gated = next((m.up_proj.out_features for m in module.modules()
                      if hasattr(m, "gate_proj") and isinstance(getattr(m, "up_proj", None), nn.Linear)), None)
        python_gelu = any(type(m).__name__ == "NewGELUActivation" for m in module.modules())
        dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())
        shape = cls(sum(numels), layers, emb.embedding_dim if emb else None, heads,
                    emb.num_embeddings if emb else None, seq, largest_layer=max(leaves, default=0),
                    numels=numels, name=name or type(module).__name__, gated_mlp=gated,
                    mlp_extra=3 if python_gelu else 0, dropout=dropout,
                    ends=ends_around(module, blocks) if blocks is not None else ())
        config = getattr(module, "config", None)  # Hugging Face's and nanoGPT's models carry their shape
        if config is None:
            return shape
        get = lambda *keys: next((v for v in (getattr(config, k, None) for k in keys) if isinstance(v, int) and v), None)
        return replace(shape, cache_kv=getattr(config, "use_cache", False) is True,
                       layers=get("num_hidden_layers", "n_layer") or shape.layers,
                       hidden=get("hidden_size", "n_embd") or shape.hidden,
                       heads=get("num_attention_heads", "n_head") or shape.heads,
                       vocab=get("vocab_size") or shape.vocab, kv_heads=get("num_key_value_heads"))


def ends_around(module, blocks: str) -> tuple:
    """ModelShape.ends of ``module`` whose blocks are the ModuleList named ``blocks``: its parameters
    registered before the blocks and after them, as nbtool.rank.pipeline cuts stages (torchtitan's
    convention: the first stage keeps what precedes the blocks, the last what follows; a run records
    them around the blocks its pipeline would split, from_module around the longest ModuleList)."""
    sides: dict = {}  # id -> (numel, {"before", "after"})
    seen = False
    for name, p in module.named_parameters(remove_duplicate=False):  # a tied head: under both its names
        if name.startswith(blocks + "."):
            seen = True
            continue
        sides.setdefault(id(p), (p.numel(), set()))[1].add("after" if seen else "before")
    pick = lambda *want: tuple(n for n, where in sides.values() if set(want) <= where)
    return pick("before"), pick("after"), pick("before", "after")


# Well-known shapes. The Llama-3, Mistral and Qwen2.5 entries are built from
# their published configs and count exactly what those models hold
# (8,030,261,248 / 7,241,732,096 / 7,615,616,512); the others use the GPT
# formula (no gated MLP or grouped-query attention), approximate for Llama-2.
MODEL_PRESETS = {
    "Llama-3-8B": ModelShape.decoder(32, 4096, 32, 128256, 8192, kv_heads=8, intermediate=14336,
                                     name="Llama-3-8B"),
    "Mistral-7B": ModelShape.decoder(32, 4096, 32, 32000, 32768, kv_heads=8, intermediate=14336,
                                     name="Mistral-7B"),
    "Qwen2.5-7B": ModelShape.decoder(28, 3584, 28, 152064, 32768, kv_heads=4, intermediate=18944, qkv_bias=True,
                                     name="Qwen2.5-7B"),
    "GPT-2 small (124M)": ModelShape.transformer(12, 768, 12, 50257, 1024, "GPT-2 small"),
    "GPT-2 XL (1.5B)": ModelShape.transformer(48, 1600, 25, 50257, 1024, "GPT-2 XL"),
    "7B (Llama-2-7B shape)": ModelShape.transformer(32, 4096, 32, 32000, 4096, "7B"),
    "13B (Llama-2-13B shape)": ModelShape.transformer(40, 5120, 40, 32000, 4096, "13B"),
    "70B-class (80L, 8192h)": ModelShape.transformer(80, 8192, 64, 32000, 4096, "70B-class"),
    "GPT-3 175B": ModelShape.transformer(96, 12288, 96, 50257, 2048, "GPT-3 175B"),
}


# what a run records of its model's structure for the planner (nbtool.rank.strategies; nbtool.plan.versus)
RECORDED_SHAPE = ("layers", "hidden", "heads", "vocab", "largest_layer", "gated_mlp", "kv_heads", "mlp_extra",
                  "dropout", "cache_kv", "ends")


@dataclass(frozen=True)
class Training:
    micro_batch: int = 1
    seq: int | None = None  # default: the model's
    precision: str = "bf16"  # fp32 | bf16 | fp16 (mixed precision for the latter two)
    optimizer: str = "adamw"  # adam | adamw | sgd | sgd-momentum
    grad_accum: int = 1
    checkpointing: str = "none"  # none | selective | full
    # fused attention (FlashAttention / torch SDPA) saves no s x s score matrices:
    # Korthikanti's 5 a s / h term drops out
    fused_attention: bool = True


@dataclass(frozen=True)
class Hardware:
    """Devices and links. Memory in bytes, bandwidth in bus bytes/s, latency in seconds."""

    name: str
    nodes: int
    devices_per_node: int
    device_memory: float
    host_memory: float  # per node
    intra_bw: float
    inter_bw: float
    intra_latency: float = 10e-6
    inter_latency: float = 20e-6
    link: str = ""
    peak_flops: float = 312e12  # dense bf16 per device (fp32: a quarter on GPUs)
    host_link_bw: float = 25 * 1e9  # device <-> host (PCIe) bytes/s, for offload
    measured: bool = False
    # CPU ranks: their step time outside communication over nbtool.plan.cpu_costs' reference machine's
    # (None: devices, whose kernels hide the host's work; compute comes from peak_flops)
    host_speed: float | None = None
    # CPU ranks: (fp32, bf16) FLOP/s of one Linear's forward and backward there (nbtool.rank.matmul_probe);
    # None: bf16 as on the reference machine, where it is native (cpu_costs.S_PER_GFLOP_16BIT)
    matmul_flops: tuple | None = None
    # per-op links within a node, ((op, alpha, B), ...), where an op costs more than the generic link
    # gives: gloo's reduce-scatter is an all-reduce plus flat copies; CPU ranks in training pay more
    # latency per collective than a quiet sweep (nbtool.plan.cpu_costs.COLLECTIVES); %commbench's own fits
    op_links: tuple = ()
    # bytes per device that CUDA libraries take from PyTorch's allocator: cuBLAS's workspaces, one per
    # thread that runs matmuls (the cell's and autograd's backward thread); see cublas_workspace()
    workspace: float = 0.0

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def speedup_16bit(self) -> float | None:
        """CPU ranks: bf16's measured FLOP rate over fp32's (below 1 where the CPU emulates bf16)."""
        return self.matmul_flops[1] / self.matmul_flops[0] if self.matmul_flops else None

    @property
    def bf16_flops(self) -> float | None:
        return self.matmul_flops[1] if self.matmul_flops else None

    def emulated_bf16(self) -> str:
        """Where CPU ranks measured bf16 slower than fp32, a sentence saying so (for the table's note,
        %dist_plan and advice); else ""."""
        slow = self.speedup_16bit if self.host_speed is not None else None
        if slow is None or slow >= 1:
            return ""
        return (f"bf16 computes at x{slow:.2g} fp32's FLOP rate on these CPU ranks (measured: one Linear's "
                "forward and backward; the CPU emulates it)")

    def bandwidth(self, group: int, op: str | None = None, fallback: str | None = None) -> tuple[float, float]:
        """(alpha, B) for a collective ``op`` over ``group`` devices: within a node the op's own link
        where one is known (else ``fallback``'s, else the node's), across nodes the inter-node link."""
        if group <= self.devices_per_node:
            links = {o: (a, b) for o, a, b in self.op_links}
            return links.get(op) or links.get(fallback) or (self.intra_latency, self.intra_bw)
        return self.inter_latency, self.inter_bw

    def collective_s(self, op: str, group: int, count: float, bus_bytes: float, fallback: str | None = None) -> float:
        """Seconds for ``count`` collectives ``op`` over ``group`` devices moving ``bus_bytes`` in all:
        count x alpha + bus bytes / B."""
        alpha, bw = self.bandwidth(group, op, fallback)
        return count * alpha + bus_bytes / bw

    def with_op_links(self, links: dict) -> "Hardware":
        """This hardware with ``links`` ({op: (alpha, B)}) replacing those ops' own links."""
        kept = tuple(x for x in self.op_links if x[0] not in links)
        return replace(self, op_links=kept + tuple((op, a, b) for op, (a, b) in sorted(links.items())))

    def with_commbench(self, result) -> "Hardware":
        """Use %commbench all_reduce fits (alpha, bus B) for the links they measured: each link's
        own part of a sweep across hosts (CommbenchLinks), else the one result's link, else the
        intra-node link when its ranks fit in a node. Within a node every op the sweep fitted
        (all_gather, reduce_scatter, ...) also becomes that op's own link."""
        parts = [r for r in result.parts if "all_reduce" in r.fits]
        if not parts:
            raise ValueError("the commbench result has no all_reduce fit; run %commbench all_reduce over several sizes")
        if any(r.link for r in parts):
            parts = [r for r in parts if r.link]  # the mixed world sweep measures neither link alone
        hw = self
        for r in parts:
            fit = r.fits["all_reduce"]
            intra = r.link == "intra-host" or (not r.link and len(r.ranks) <= self.devices_per_node)
            if intra:
                hw = replace(hw, intra_latency=fit.alpha_s, intra_bw=fit.bus_bandwidth, measured=True)
                # every op the sweep fitted keeps its own link (all_reduce's is the generic one)
                hw = hw.with_op_links({op: (f.alpha_s, f.bus_bandwidth) for op, f in r.fits.items()
                                       if 0 < f.bus_bandwidth < float("inf") and f.alpha_s >= 0})
            else:
                hw = replace(hw, inter_latency=fit.alpha_s, inter_bw=fit.bus_bandwidth, measured=True)
        return hw

    def with_devices(self, devices: int) -> "Hardware":
        """The same kind of machine with ``devices`` devices (filling nodes of this size first)."""
        per_node = min(self.devices_per_node, max(1, devices))
        return self.scaled(nodes=max(1, -(-devices // per_node)), devices_per_node=per_node)

    def scaled(self, nodes: int | None = None, devices_per_node: int | None = None) -> "Hardware":
        return replace(self, nodes=nodes or self.nodes, devices_per_node=devices_per_node or self.devices_per_node)


def cublas_workspace(major: int, config: str | None = None, threads: int = 2) -> int:
    """Bytes of cuBLAS workspace a training step holds on a GPU of compute capability ``major``:
    PyTorch gives each (handle, stream) one workspace from its caching allocator, and a step uses two
    handles (forward on the cell's thread, backward on autograd's). Size per workspace: the sum of
    ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KiB:COUNT`` pairs when set, else PyTorch's default: 32 MiB on
    Hopper and later (2 x 32 MiB measured on an H200 by benchmarks/gpu_check.py), ``:4096:2:16:8``
    (8 MiB + 128 KiB) before."""
    if config:
        nums = [int(x) for x in re.findall(r"\d+", config)]
        per = sum(a * b for a, b in zip(nums[0::2], nums[1::2])) * 1024
    else:
        per = 32 * MiB if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return threads * per


# Documented defaults (approximate busbw of a large all_reduce, as nccl-tests reports):
# A100 NVLink3 ~230 GB/s, H100 NVLink4 ~360 GB/s, PCIe 4.0 x16 ~20 GB/s, HDR InfiniBand
# 200 Gb/s per GPU ~23 GB/s; 2 gloo CPU ranks on one host ~1.2 GB/s (a quiet sweep, measured here;
# in training each op costs more: its own link, from nbtool.plan.cpu_costs.COLLECTIVES).
HARDWARE_PRESETS = {
    "8x A100-40GB NVLink": Hardware("8x A100-40GB NVLink", 1, 8, 40 * GiB, 1024 * GiB, 230 * GB, 23 * GB,
                                    link="NVLink3", peak_flops=312e12, workspace=cublas_workspace(8)),
    "8x A100-80GB NVLink": Hardware("8x A100-80GB NVLink", 1, 8, 80 * GiB, 1024 * GiB, 230 * GB, 23 * GB,
                                    link="NVLink3", peak_flops=312e12, workspace=cublas_workspace(8)),
    "8x H100-80GB NVLink": Hardware("8x H100-80GB NVLink", 1, 8, 80 * GiB, 2048 * GiB, 360 * GB, 45 * GB,
                                    link="NVLink4", peak_flops=989e12, host_link_bw=50 * GB,
                                    workspace=cublas_workspace(9)),
    "4x RTX 4090 PCIe": Hardware("4x RTX 4090 PCIe", 1, 4, 24 * GiB, 128 * GiB, 20 * GB, 10 * GB,
                                 link="PCIe 4.0", peak_flops=165e12, workspace=cublas_workspace(8)),
    "2 CPU ranks (gloo)": Hardware("2 CPU ranks (gloo)", 1, 2, 24 * GiB, 24 * GiB, 1.2 * GB, 1.2 * GB,
                                   intra_latency=300e-6, inter_latency=300e-6, link="shared memory / loopback",
                                   peak_flops=0.05e12, host_link_bw=10 * GB, host_speed=1.0,
                                   op_links=tuple((op, a, b) for op, (a, b) in COLLECTIVES.items())),
}
