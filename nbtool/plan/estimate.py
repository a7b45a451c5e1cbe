"""Per-device memory, communication and a step-time estimate for one layout.

Sources, per figure:

- model states: for DDP and FSDP, what nbtool's strategies hold
  (``expected_ledger``: fp32 weights, gradients and Adam state, sharded by
  FSDP; bf16 compute via autocast / MixedPrecisionPolicy); DDP adds its
  gradient buckets (a second copy of the gradients unless
  ``--grad-as-bucket-view``); FSDP holds gathered units as buffers: none as
  the loss's backward starts (the root unit resharded after forward too);
  the root unit (embeddings, final norm, head) twice over as the head's
  backward starts, the loss's first gradients gone; in the blocks' backward
  the root, kept to the end, and 2 units (the current one and the prefetched
  one; all of them between forward and backward without resharding), every
  block's activation alive, on CPU ranks one more: gloo's flat copy of the
  gathered output. Or, where larger (bf16: its fp32 reduction does not halve), at the
  last block's reduce-scatter, that block's activations gone: the prefetched
  unit, the gradients cast to the reduction dtype, the output shard, and on
  CPU ranks gloo's copy of the input. For ZeRO in mixed precision,
  DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``,
  ``estimate_zero3_model_states_mem_needs``): 2 bytes of 16-bit parameters
  (partitioned in stage 3) plus 18 bytes per parameter / N (16-bit and fp32
  gradients, fp32 master weights, Adam moments), stage 3 plus one largest
  layer in fp32; with offload the partitioned states move to the host
  (x 1.5 buffer factor, as DeepSpeed estimates). Every ZeRO stage adds its
  contiguous gradient bucket: reduce_bucket_size elements of the gradient
  dtype (5e8 by default, whatever the model's size; measured; two of them in
  ZeRO-1/2 with --overlap-comm). ZeRO-1 keeps the full
  16-bit gradients: 4 Psi + 16 Psi / N.
- activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation
  in Large Transformer Models", table 2), bytes per layer with 16-bit
  activations: s b h (34 + 5 a s / h) without tensor parallelism;
  s b h (10 + 24/t + 5 a s / (h t)) with t-way tensor parallelism;
  s b h (34 + 5 a s / h) / t with sequence parallelism too; selective
  recomputation drops the 5 a s / h term; full recomputation keeps only each
  layer's input, 2 s b h (/ t with SP). Counted with the element width
  (2 bytes, 4 in fp32) where Korthikanti counts 16-bit values, and the two
  1-byte dropout masks a layer only where the model has dropout (the
  tutorial model and GPT-2 at p = 0 have none: fp32, tp=2, 40 s b h a layer
  measured, 36 with SP, as now counted; the masks doubled as fp32 had put
  them 4 over); the final norm's input and output (the head's input) are
  counted once. With fused attention (FlashAttention,
  torch SDPA; ``Training.fused_attention``, the default) no s x s scores are
  saved, so the 5 a s / h term drops out as with selective recomputation.
  A Llama-style decoder (a gated MLP I wide, RMSNorms, grouped-query k and
  v: Hugging Face's Llama, Qwen2, Mistral) has its own count, tensor by
  tensor (``_gated_layer``): within 1% of what autograd saved in fp32 and
  pure bf16, 4% under autocast, on three shapes (Korthikanti's layer was 17%
  short at I = 2h, 71% at I = 4h).
  FSDP around tensor/pipeline parallelism (fsdp --tp/--pp; the planner's
  mixed-precision lines with dp above 1) shards each rank's states over dp
  and gathers and reduce-scatters its stage's units over it
  (``_fsdp_over_dp``): a pipeline keeps every unit gathered, and its
  gradients accumulating unsharded in fp32, from the stage's first backward
  to the step's end (measured on 4 CPU ranks: states and bytes exact, peaks
  within 5%).
  1F1B pipelines hold p micro-batches
  of L/p layers on the first stage, i.e. L layers' worth (and, from the
  second micro-batch on, the largest weight's gradient computed before it
  is added to .grad: a buffer). The LM head adds s b V x 12 bytes as
  backward starts: the loss's fp32 log-softmax output, saved, and
  backward's first two gradients (nll's, log-softmax's; measured on CPU
  ranks and an H200), whole on every tp rank (nbtool's tp keeps the head
  replicated). fp32 training doubles the 16-bit values. Mixed precision by
  torch.autocast over fp32 weights (ddp, tp, pp) saves more than the pure
  16-bit count: a 16-bit copy of every matmul weight (2 bytes x all but the
  token embedding), both norms' fp32 inputs (+4 s b h a layer) and one copy
  of the norm's output per separate q, k, v projection (+4 s b h; none with
  a fused qkv matrix): within 2% of what autograd saved on three shapes,
  and 2% over an H200's allocator for a 117M model (1.94 GB predicted,
  1.90 measured with the loss's gradients).
- the peak (DDP, FSDP, tp/pp: torch's optimizers, gradients set to None by
  zero_grad) is the larger of two moments: backward's start, every
  activation saved and no gradient yet (with gradient accumulation the
  earlier micro-batches' are there), and the optimizer step, gradients and
  no activations, plus Adam's temporaries: on GPUs its foreach kernels'
  (one fp32 copy of the parameters), on CPU ranks, one tensor at a time,
  two copies of the largest (its second moment's square root and quotient).
  ``Estimate.device`` holds that moment's bytes, ``Estimate.states`` what
  the device owns over the step (the ledger's).
- communication per optimizer step, in bus bytes (S x nccl-tests factor):
  DDP all-reduce 2 (n-1)/n Psi g; FSDP without resharding reduce-scatters
  gradients and all-gathers parameters, 2 (n-1)/n Psi; FSDP all-gathers
  twice, 3 (n-1)/n Psi (ZeRO paper section 7). DeepSpeed, as measured by
  nbtool's recorder: ZeRO-1/2 all-reduce the gradient buckets
  (``use_multi_rank_bucket_allreduce``, its default) and all-gather the
  updated partitions, 3 (n-1)/n Psi rather than the paper's 2; ZeRO-3
  reduce-scatters gradients and gathers each tensor above the persistence
  threshold twice (once when they add up to at most the reuse limit,
  stage3_max_reuse_distance / max_live_parameters: kept gathered for
  backward), the smaller ones (whole on every rank) once after the step
  (counted when the model's tensor sizes are known); tensor
  parallelism 4 all-reduces of s b h per layer per micro-batch (Megatron; in
  the activations' dtype); with sequence parallelism each becomes a
  reduce-scatter and an all-gather (the same bus bytes), plus 2 all-gathers
  of s b h per micro-batch (the first block's input gradient, the last
  block's output for the whole-sequence head) and one fp32 all-reduce a step
  of the norms' partial gradients (measured: the recorder's bytes exactly);
  pipelines 2 sends of s b h per micro-batch per stage boundary (16-bit, or
  fp32 without mixed precision).
- collectives per step, per op (``Estimate.comms``; each pays alpha once),
  as the recorder counts them: DDP one all-reduce per bucket (torch's
  default: a first bucket of 1 MiB, then 25 MiB ones); FSDP per
  unit (one per block plus the root's) one reduce-scatter a step and one
  all-gather a micro-batch (two when resharded after forward; the earlier
  micro-batches' gradients accumulate unsharded, in fp32, until the last's
  reduce-scatter: buffers at the peak); ZeRO-1/2 one all-reduce per
  reduce_bucket_size and one all-gather per allgather_bucket_size; ZeRO-3
  one all-gather per parameter tensor each time it is fetched (70 a step for
  the tutorial model's 70 tensors: measured) and one reduce-scatter per
  bucket; every ZeRO stage one scalar all-reduce (the overflow check).
- time: compute = 6 Psi tokens (x 4/3 with full recomputation) / (peak
  FLOPs x 40% utilisation); data-parallel communication overlaps backward
  (2/3 of compute) and only the excess is exposed; tensor-parallel and
  pipeline communication, pipeline bubbles ((p-1)/(m+p-1) of the step: compute x (p-1)/m) and offload
  transfers (device <-> host) are not hidden. A pipeline rank's FLOPs are its stages' blocks', and the
  head's on the last stage's rank (``pipeline_work``; the embeddings are a lookup): compute is rank
  0's, as measured, and its bubble holds the other stages' warm-up and drain and its wait for the
  slowest stage (Llama-3-8B over 4 ranks: the last runs 30% of the FLOPs, the others 23%). Each op costs count x alpha
  + bus bytes / B on its own link where the hardware has one
  (``Hardware.op_links``: ``%commbench``'s fit per op; on CPU ranks the
  in-training table nbtool.plan.cpu_costs.COLLECTIVES, ZeRO-3's fetches and
  DDP's buckets, in flight while backward runs, and a pipeline's sends and
  receives, rows of their own), else the node's link. On CPU
  ranks (``Hardware.host_speed`` set) compute is the measured per-strategy
  model of nbtool.plan.cpu_costs (FLOPs plus the host's work per parameter
  tensor), and no communication is hidden: gloo shares the cores; the
  collectives inside forward and backward (tp's all-reduces, pp's sends and
  receives) also wait for the other rank's host jitter, a measured fraction
  of the compute between them (``cpu_costs.SYNC_WAIT``); sequence
  parallelism's gathers and scatters cost their own rows' time (fitted on
  tp --sp runs, in training: their wait for the other rank is in them) and
  DTensor's host work per collective (``cpu_costs.S_PER_SP_COLLECTIVE``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..spec import bubble_fraction, first_rank_held, first_rank_hops, stage_actions, stage_indices
from . import cpu_costs
from .layouts import Layout
from .layouts import DDP, ZERO2, ZERO2_OFFLOAD, ZERO3, ZERO3_OFFLOAD, ZERO3_OFFLOAD_OPTIMIZER
from .layouts import layout as as_layout
from .inputs import Hardware, ModelShape, Training, format_count, format_gb
from .model_states import OPTIMIZER_STATE_BYTES, PERSISTENCE_THRESHOLD, expected_ledger

MFU = 0.4
RESERVE = 0.10  # keep 10% of device memory free (allocator fragmentation, CUDA context)
DDP_BUCKET = 25 * 2**20
DDP_FIRST_BUCKET = 2**20  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES, where bucket_cap_mb is left at its default
# DeepSpeed's default reduce_bucket_size (elements): ZeRO allocates a gradient bucket of this many
# elements of the gradient dtype whatever the model's size (measured: 2 GB in fp32 on CPU ranks)
REDUCE_BUCKET = 500_000_000
# DeepSpeed's default stage3_max_reuse_distance and stage3_max_live_parameters: ZeRO-3 keeps parameters
# gathered in forward for backward while the partitioned ones add up to at most this many elements
REUSE_LIMIT = 1_000_000_000
# a pipeline's point-to-point traffic: the recorder's send and recv records together
P2P = "send/recv"
# the op link of ZeRO-3's parameter fetches (all-gathers issued ahead and waited on), where it has its own
ZERO3_FETCH = "all_gather (ZeRO-3 fetch)"
# the op link of DDP's bucket all-reduces, where it has its own (CPU ranks: their in-flight union, which the
# recorder leaves out of DDP's compute since the reducer's wait is not observable)
DDP_INFLIGHT = "all_reduce (DDP bucket)"
# the op links of sequence parallelism's activation all-gathers and reduce-scatters, where they have their
# own (CPU ranks: tens to hundreds of kB each, issued every few ms inside forward and backward; FSDP's
# parameter gathers, on which the generic rows were fitted, put them 25% and 15% over what they measured)
SP_GATHER = "all_gather (sequence parallel)"
SP_SCATTER = "reduce_scatter (sequence parallel)"
# DeepSpeed's default allgather_bucket_size (elements): ZeRO-1/2 gather the updated partitions in buckets of this
ALLGATHER_BUCKET = 500_000_000
DEFAULT_SEQ = 2048



@dataclass(frozen=True)
class Comm:
    """``count`` collectives ``op`` over ``group`` devices per optimizer step, ``bus_bytes`` in all."""

    op: str
    group: int
    count: float
    bus_bytes: float
    link: str = ""  # the Hardware op link they take, where it is not the op's own (falls back to the op's)
    wait_s: float = 0.0  # and seconds waiting for the other ranks beyond the link (CPU ranks: cpu_costs.SYNC_WAIT)


@dataclass
class Estimate:
    layout: Layout
    dp: int
    tp: int = 1
    pp: int = 1
    device: dict = field(default_factory=dict)  # category -> bytes per device
    host: float = 0.0  # bytes per node
    comm_bus_bytes: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    compute_s: float = 0.0
    bubble_s: float = 0.0
    offload_s: float = 0.0
    capacity: float = 0.0
    host_capacity: float = 0.0
    micro_batch: int = 1
    micro_batches: int = 1
    notes: list = field(default_factory=list)
    comms: list = field(default_factory=list)  # Comm per op and group: what comm_s and comm_bus_bytes add up
    # what each device owns over a step (params, grads, optimizer: the ledger's categories); ``device``
    # is what it holds at the predicted peak, which may lack some (no gradients yet at backward's start)
    states: dict = field(default_factory=dict)
    # ZeRO in mixed precision with Adam: DeepSpeed's estimator's model states, which ``device`` is built
    # from (its full 16-bit gradients among them, counted at their moment); ``states`` stays the ledger's
    estimator_states: dict = field(default_factory=dict)
    # a pipeline's ranks' ``states`` by pipeline rank (``states``: the largest one's); [] elsewhere
    rank_states: list = field(default_factory=list)
    # a pipeline's ranks' compute by pipeline rank (``compute_s``: rank 0's); one entry elsewhere
    rank_compute_s: list = field(default_factory=list)
    # a tp/pp layout's data-parallel dimension: FSDP (fsdp --tp/--pp: each rank's states sharded over
    # dp; the planner's mixed-precision lines) or plain replicas averaged by one all-reduce (tp/pp lines)
    dp_sharded: bool = False
    peak_phase: str = ""  # "backward start", "optimizer step", "head's backward", "blocks' backward",
    # "first reduce-scatter" (FSDP) or "last reduce-scatter" (ZeRO-3): where ``device`` is taken
    # FSDP with gradient accumulation reduce-scatters each micro-batch's gradients (--reduce-every-micro-batch)
    reduce_every_micro_batch: bool = False

    def add_comm(self, hw: Hardware, op: str, group: int, count: float, bus_bytes: float, link: str = "",
                 wait_s: float = 0.0) -> float:
        """Count ``count`` collectives ``op`` of ``bus_bytes`` in all, and ``wait_s`` seconds their thread
        waits for the other ranks beyond the link; returns their seconds on ``hw``."""
        if group < 2 or count <= 0:
            return 0.0
        self.comms.append(Comm(op, group, count, bus_bytes, link, wait_s))
        seconds = hw.collective_s(link or op, group, count, bus_bytes, fallback=op) + wait_s
        self.comm_bus_bytes += bus_bytes
        self.comm_s += seconds
        return seconds

    def comm_s_by_op(self, hw: Hardware) -> dict:
        """op -> predicted seconds per step on ``hw``."""
        out: dict = {}
        for c in self.comms:
            out[c.op] = out.get(c.op, 0.0) + hw.collective_s(c.link or c.op, c.group, c.count, c.bus_bytes,
                                                             fallback=c.op) + c.wait_s
        return out

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def fits(self) -> bool:
        return self.device_total <= (1 - RESERVE) * self.capacity and self.host <= self.host_capacity

    @property
    def headroom(self) -> float:
        """Free fraction of device memory left by the estimate."""
        return 1 - self.device_total / self.capacity

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s + self.offload_s

    @property
    def samples(self) -> int:
        """Samples per optimizer step over the whole machine (data-parallel replicas x micro-batches)."""
        return self.dp * self.micro_batches * self.micro_batch

    @property
    def time_per_sample(self) -> float:
        return self.step_s / self.samples

    def magic_line(self, t: Training | None = None) -> str:
        """The %%distributed line for this layout and training setup (parses back to the same choice)."""
        t = t or Training()
        words = [self._strategy_words(t)]
        if t.precision != "fp32":
            words.append(f"--precision {t.precision}")
        if self.pp > 1:  # the micro-batches are the accumulation
            words.append(f"--microbatches {t.grad_accum}")
        elif t.grad_accum > 1:
            words.append(f"--grad-accum {t.grad_accum}")
            if self.reduce_every_micro_batch:
                words.append("--reduce-every-micro-batch")
        if t.checkpointing != "none":
            words.append("--activation-checkpointing")
        if self.layout.is_zero:
            words.append(f"--micro-batch {t.micro_batch}")
        return " ".join(words)

    def spec(self, t: Training | None = None):
        """The StrategySpec the magic line asks for, for validation and configs."""
        from ..spec import StrategySpec

        t = t or Training()
        if self.layout.mesh:
            return StrategySpec(self._mesh_word(t), precision=t.precision,
                                grad_accum=t.grad_accum if self.pp == 1 else 1,
                                activation_checkpointing="" if t.checkpointing != "none" else None,
                                dp=self.dp, tp=self.tp if self.tp > 1 else None, pp=self.pp if self.pp > 1 else None,
                                sp=self.tp > 1, microbatches=t.grad_accum if self.pp > 1 else None,
                                reduce_every_micro_batch=self.reduce_every_micro_batch)
        lay = self.layout
        return StrategySpec(lay.strategy, precision=t.precision, grad_accum=t.grad_accum,
                            activation_checkpointing="" if t.checkpointing != "none" else None,
                            reshard_after_forward=lay.reshard, offload=lay.offload,
                            reduce_every_micro_batch=self.reduce_every_micro_batch,
                            micro_batch=t.micro_batch if lay.is_zero else 8)

    def _mesh_word(self, t: Training) -> str:
        # FSDP over dp (mixed precision: its MixedPrecisionPolicy), else plain replicas
        if self.dp_sharded:
            return "fsdp"
        return "pp" if self.layout == "pp" else "tp"  # tp-pp runs as tp --pp

    def _strategy_words(self, t: Training | None = None) -> str:
        t = t or Training()
        if not self.layout.mesh:
            return self.layout.words()
        return " ".join(
            [self._mesh_word(t), f"--dp {self.dp}"]
            + ([f"--tp {self.tp}", "--sp"] if self.tp > 1 else []) + ([f"--pp {self.pp}"] if self.pp > 1 else []))


def _act_per_layer(m: ModelShape, t: Training, tp: int, sp: bool, autocast: bool = False) -> float:
    s, b, h, a = (t.seq or m.seq), t.micro_batch, m.hidden, m.heads
    if t.fused_attention:
        a = 0  # no attention-score matrices saved (same as selective recomputation of attention)
    if m.gated_mlp and t.checkpointing != "full":
        return s * b * h * _gated_layer(m, t, tp, sp, autocast, 0 if t.checkpointing == "selective" else a)
    if t.checkpointing == "full":
        out = 2 * s * b * h / (tp if sp else 1)
        return 2 * out if t.precision == "fp32" else out
    out = s * b * h * _gpt_layer(m, t, tp, sp, 0 if t.checkpointing == "selective" else a)
    if t.precision == "fp32":
        return out
    if autocast:
        # torch.autocast over fp32 weights keeps the residual stream in fp32: both norms save a 4-byte
        # input (+2 s b h each), and each of separate q, k, v projections casts its own 16-bit copy of
        # the norm's output (+4 s b h; one copy when q, k, v are one fused matrix). Measured per layer
        # on CPU ranks: 40 s b h, against 32 for the same model in pure bf16
        out += s * b * h * (4 + (0 if _fused_qkv(m) else 4)) / (tp if sp else 1)
    return out


def _gpt_layer(m: ModelShape, t: Training, tp: int, sp: bool, a: int) -> float:
    """Bytes per s b h that one GPT-style layer (LayerNorms, a 4h MLP) saves for backward:
    Korthikanti's count with the element width w (2 bytes, fp32 4) where it counts 16-bit values and a
    dropout mask 1 byte whatever the precision, only where the model has dropout. Whole on every tp
    rank: both LayerNorms' inputs (2 w, split under sequence parallelism), the inputs of qkv and of the
    MLP's first matrix (2 w; gathered under sequence parallelism) and the two residual dropout masks
    (2, split under sequence parallelism); split by tp: q, k, v and the output projection's input
    (4 w), the MLP's GeLU input and output (8 w), an activation function's own extra 4h-wide tensors
    (4 w each), unfused attention's scores: softmax output (w) and its dropout's mask and output
    (1 + w), a s / h each, and where q, k and v are views of one fused output that a Hugging Face
    cache copies k and v from (GPT-2), those copies (2 w). Measured on CPU ranks in fp32 without
    dropout, tp=2: 40 s b h, sp: 36; GPT-2 (its cache, gelu_new) 68, as counted."""
    w = 4 if t.precision == "fp32" else 2
    masks = 2 if m.dropout else 0
    split = 12 * w + 4 * w * m.mlp_extra + (w + (1 + w if m.dropout else 0)) * a * (t.seq or m.seq) / m.hidden
    if m.cache_kv and _fused_qkv(m):
        split += 2 * w
    if sp:
        return (2 * w + masks + split) / tp + 2 * w
    return 4 * w + masks + split / tp


def _gated_layer(m: ModelShape, t: Training, tp: int, sp: bool, autocast: bool, a: int) -> float:
    """Bytes per s b h that one Llama-style layer saves for backward (Hugging Face's Llama, Qwen2,
    Mistral; counted tensor by tensor on CPU, fp32 84, autocast 56 and pure bf16 46 with I = 3h and
    half the heads for k and v, as this gives): two RMSNorms (each its fp32 input and the normalized
    output: fp32 under fp32 or autocast, else 16-bit), the inputs of q/k/v and of gate/up (one each;
    under autocast each projection casts its own 16-bit copy; whole on every tp rank, gathered under
    sequence parallelism) and, split by tp, o_proj's input, SDPA's
    q, k, v (k and v at the key/value heads) and the MLP's gate, SiLU, up and product (I wide each);
    unfused attention adds its softmax output (2 a s / h; no dropout in these models)."""
    fp32, s = t.precision == "fp32", (t.seq or m.seq)
    w = 4 if fp32 else 2
    kv = (m.kv_heads or m.heads) / m.heads
    norms = 16 if fp32 or autocast else 12
    unsplit = 2 * ((1 if _fused_qkv(m) else 3) + 2) if autocast else 2 * w
    split = w * (2 + 2 * kv + 4 * m.gated_mlp / m.hidden) + w * a * s / m.hidden
    # under sequence parallelism the norms are split too, the gathered q/k/v and gate/up inputs are not
    return (norms + split) / tp + unsplit if sp else norms + unsplit + split / tp


def _rank_stages(pp: int, virtual: int, schedule: str):
    """Per pipeline rank: (its share of the blocks, whether it runs the first stage, the last)."""
    stages = pp * virtual
    for r in range(pp):
        mine = stage_indices(r, pp, virtual, schedule)
        yield len(mine) / stages, 0 in mine, stages - 1 in mine


def pipeline_holdings(m: ModelShape, pp: int, virtual: int = 1, schedule: str = "1f1b", tied: tuple = ()) -> list:
    """[(parameter elements, parameter tensors)] each pipeline rank holds, by nbtool.rank.pipeline's split:
    the blocks evenly over the pp x V stages, the first stage's ends (embeddings) and the last's (final
    norm, head) on the ranks running those (both on rank 0 under ZB-V). Without ``m.ends``, everything
    evenly over the ranks, and each weight tied across stages (``tied``: their elements) once more."""
    numels = list(m.numels) or [m.params]
    if pp == 1 or not m.ends:
        return [((m.params + sum(tied)) / pp, (len(numels) + len(tied)) / pp)] * pp
    before, after, shared = m.ends
    block_elements = m.params - sum(before) - sum(after) + sum(shared)
    # tensors: counted where the module was (a shape from a formula has one in all)
    block_tensors = len(numels) - len(before) - len(after) + len(shared) if m.numels else 0
    out = []
    for share, first, last in _rank_stages(pp, virtual, schedule):
        elements, tensors = block_elements * share, block_tensors * share
        for part, held in ((before, first), (after, last)):
            if held:
                elements, tensors = elements + sum(part), tensors + len(part)
        if first and last:  # a weight tied between the ends: one tensor
            elements, tensors = elements - sum(shared), tensors - len(shared)
        out.append((elements, tensors if m.numels else 1 / pp))
    return out


def pipeline_work(m: ModelShape, pp: int, virtual: int = 1, schedule: str = "1f1b") -> list:
    """Each pipeline rank's share of a step's FLOPs: its stages' blocks, and the final norm and head on
    the last stage's rank (a matmul of the vocabulary's width: Llama-3-8B's head is 2.4 blocks' worth);
    the first stage's embeddings are a lookup. Evenly without ``m.ends``."""
    if pp == 1 or not m.ends:
        return [1.0 / pp] * pp
    before, after, shared = m.ends
    blocks = m.params - sum(before) - sum(after) + sum(shared)
    work = [blocks * share + (sum(after) if last else 0) for share, _, last in _rank_stages(pp, virtual, schedule)]
    return [w / sum(work) for w in work]


def _block_params(m: ModelShape) -> float:
    """One transformer block's weights (an FSDP unit): 12 h^2 for GPT's; q, o, k and v (k, v at the
    key/value heads) and a gated MLP's three I x h matrices for a Llama-style one."""
    h = m.hidden or 0
    if not m.gated_mlp or not m.heads:
        return 12 * h * h
    kv = (m.kv_heads or m.heads) * (h // m.heads)
    return 2 * h * h + 2 * h * kv + 3 * h * m.gated_mlp + 2 * h  # and its two RMSNorms


def _root_params(m: ModelShape) -> float:
    """The parameters outside the blocks (embeddings, final norm, head: FSDP's root unit): the model's
    ends where known (a tied weight once), else what the blocks leave."""
    if m.ends:
        before, after, shared = m.ends
        return sum(before) + sum(after) - sum(shared)
    return max(m.params - (m.layers or 0) * _block_params(m), 0)


def _fused_qkv(m: ModelShape) -> bool:
    """Whether q, k and v are one matrix (nanoGPT's c_attn, GPT-2's Conv1D); unknown: separate."""
    h = m.hidden or 0
    return bool(h) and any(n == 3 * h * h for n in m.numels)


def activations(m: ModelShape, t: Training, tp: int = 1, pp: int = 1, sp: bool = True,
                autocast: bool = False, held: float = 1.0) -> float:
    """Peak activation bytes on the busiest device, at backward's start (see the module docstring).
    ``autocast``: 16-bit compute over fp32 weights (torch.autocast), which saves a 16-bit copy of every
    weight a matmul uses and keeps the residual stream in fp32. ``held``: a pipeline schedule's layers'
    worth of activations on its first rank over 1F1B's (nbtool.spec.first_rank_held)."""
    if not (m.layers and m.hidden and m.heads and (t.seq or m.seq)):
        return 0.0
    cast = autocast and t.precision != "fp32"  # 16-bit compute over fp32 weights
    per_layer = _act_per_layer(m, t, tp, sp and tp > 1, cast)
    s, b = (t.seq or m.seq), t.micro_batch
    # the loss over fp32 logits: log_softmax's output, saved, and backward's first two gradients
    # (nll's, then log_softmax's), alive together as backward starts: 12 bytes x s b V, whole on every
    # tp rank (nbtool's tp keeps the head replicated: measured, the full s b V on each)
    head = s * b * (m.vocab or 0) * 12
    out = m.layers * per_layer * held + head  # 1F1B: the first stage holds L layers' worth
    fp32 = t.precision == "fp32"
    if m.gated_mlp and t.checkpointing != "full" and pp == 1:
        # the final RMSNorm (as a layer's) and the head's input (16-bit under autocast), whole on every tp rank
        out += s * b * m.hidden * ((8 if fp32 or cast else 6) + (4 if fp32 else 2))
    elif t.checkpointing != "full" and pp == 1:
        # the final LayerNorm's input (fp32 under autocast; gathered under sequence parallelism) and its
        # output, the head's input (16-bit under autocast), whole on every tp rank
        out += s * b * m.hidden * ((4 if fp32 or cast else 2) + (4 if fp32 else 2))
    if cast and t.checkpointing != "full":
        # autocast's cached 16-bit weights, saved for backward: every matmul weight (all but the
        # token embedding) in 2 bytes (full recomputation saves only each layer's input)
        out += 2 * max(m.params - (m.vocab or 0) * m.hidden, 0) / (tp * pp)
    return out


def estimate(layout: Layout | str, m: ModelShape, t: Training, hw: Hardware, tp: int = 1, pp: int = 1,
             persistence_threshold: int = PERSISTENCE_THRESHOLD, reduce_bucket: int = REDUCE_BUCKET,
             reuse_limit: int = REUSE_LIMIT, compress: float = 1.0, shard: int | None = None,
             whole: int | tuple = 0,
             schedule: str = "1f1b", virtual: int = 1, sp: bool = True, overlap_comm: bool = False,
             tied: tuple = (), prefetch_bucket: int | None = None, ddp_bucket: float | None = None,
             tp_split_parts: int | None = None, fsdp_dp: bool | None = None,
             mesh_reshard: bool = True, reduce_every_micro_batch: bool = False) -> Estimate:
    """``persistence_threshold``: ZeRO-3's stage3_param_persistence_threshold; ``reduce_bucket``: ZeRO's
    reduce_bucket_size in elements; ``reuse_limit``: the smaller of ZeRO-3's stage3_max_reuse_distance and
    stage3_max_live_parameters (DeepSpeed's defaults); ``prefetch_bucket``: ZeRO-3's
    stage3_prefetch_bucket_size (None: DeepSpeed's default, 5e7); ``compress``: DDP's gradient bytes after a
    compression hook over before (fp16/bf16: 0.5; PowerSGD: see nbtool.plan.versus); ``shard``: fsdp's
    shard group under hybrid sharding (--dp-shard; the rest replicate it), default every device;
    ``whole``: elements fsdp keeps whole on every device (--replicate), or that tensor parallelism leaves
    whole on every tp rank (embeddings, norms: the run's tp_replicated_elements; under a pipeline a tuple, one
    per pipeline rank: its stages'); ``schedule``, ``virtual``: the
    pipeline schedule and its stages per rank (the bubble, and the sends of rank 0); ``sp``: sequence
    parallelism with tp (the layouts the planner recommends use it; a run says whether it did);
    ``overlap_comm``: ZeRO-1/2's --overlap-comm (a second reduce bucket, to fill while the first is reduced);
    ``tied``: the elements of each weight tied across pipeline stages (GPT-2's embedding and head: a copy
    on each stage holding either, whose gradients nbtool all-reduces over pp every step); ``ddp_bucket``: DDP's
    bucket_cap_mb in bytes (--bucket-mb; None: torch's default, a first bucket of 1 MiB, then 25 MiB ones);
    ``tp_split_parts``: the block parts tensor parallelism splits (a row-parallel projection each, all
    layers; without --sp each all-reduces once forward and once backward), where a plan left some whole
    (nanoGPT's attention, reshaped by the full width: only its MLP is split); None: each layer's attention
    and MLP. ``fsdp_dp``: a tp/pp layout's data parallelism is FSDP (fsdp --tp/--pp: the states sharded
    over dp, each stage's units gathered and reduce-scattered over it; ``mesh_reshard``: its
    --reshard-after-forward), not plain replicas; None: as the layout's line runs (FSDP over a dp
    above 1 in mixed precision, its MixedPrecisionPolicy). ``reduce_every_micro_batch``: FSDP with gradient
    accumulation reduce-scatters each micro-batch's gradients and adds up the shards (--reduce-every-micro-batch),
    instead of holding them unsharded in fp32 until the last micro-batch."""
    layout = as_layout(layout)
    n = hw.devices // (tp * pp)
    e = Estimate(layout, n, tp, pp, capacity=hw.device_memory, host_capacity=hw.host_memory,
                 micro_batch=t.micro_batch, micro_batches=t.grad_accum,
                 reduce_every_micro_batch=reduce_every_micro_batch)
    psi = m.params
    mixed = t.precision in ("bf16", "fp16")
    adam = t.optimizer in ("adam", "adamw")
    ledger_optimizer = "adam" if adam else t.optimizer  # expected_ledger's names
    numels = list(m.numels) or [psi]
    largest = m.largest_layer or 0
    frac = (n - 1) / n if n > 1 else 0.0
    held = first_rank_held(pp, virtual, t.grad_accum, schedule) if pp > 1 else 1.0
    # FSDP over a dp of 1 would shard nothing and still copy every weight: replicas (autocast) there
    e.dp_sharded = layout.mesh and (mixed and n > 1 if fsdp_dp is None else fsdp_dp)
    # autocast over fp32 weights: ddp, and tp/pp's replicas (FSDP casts the weights themselves)
    act = activations(m, t, tp, pp, sp, autocast=mixed and (layout == DDP or (layout.mesh and not e.dp_sharded)),
                      held=held)
    e.device["activations"] = act
    if hw.workspace:  # cuBLAS's workspaces, from the same allocator as the tensors (nbtool.plan.inputs)
        e.device["workspace"] = hw.workspace
    seq, assumed = sequence(m, t)
    tokens = t.micro_batch * seq * t.grad_accum
    if assumed:
        e.notes.append(f"sequence length not given: compute assumes {DEFAULT_SEQ} tokens per sample")
    flops = 6 * psi * tokens * (4 / 3 if t.checkpointing == "full" else 1)
    # one replica's work, split over its tp devices and its pipeline ranks by their stages' work: the
    # slowest stage sets a pipeline's pace
    stages = list(zip(pipeline_work(m, pp, virtual, schedule),
                      (n for _, n in pipeline_holdings(m, pp, virtual, schedule)))) if layout.mesh and pp > 1 \
        else [(1.0, len(numels))]
    cpu = hw.host_speed is not None
    if cpu:  # CPU ranks: the host's per-tensor work, measured per strategy (nbtool.plan.cpu_costs)
        per_rank = [cpu_costs.step_s(layout, t.precision, flops * share / tp / 1e9, tensors, hw.host_speed,
                                     hw.bf16_flops, t.grad_accum, stage_actions(virtual, schedule))
                    for share, tensors in stages]
    else:
        per_rank = [flops * share / tp / (hw.peak_flops * (1 if mixed else 0.25) * MFU) for share, _ in stages]
    # a pipeline's: rank 0's stage, as its compute is measured (nbtool.plan.versus.measured_compute_s);
    # the slowest stage sets the pace, and rank 0 waits out the difference (the bubble's, below)
    e.compute_s, e.rank_compute_s = per_rank[0], per_rank

    if layout.mesh:
        tied = tuple(tied) if pp > 1 else ()
        # each pipeline rank's (elements, tensors), its share of the tp-split ones; ``whole``: what tp
        # leaves whole on every tp rank (per pipeline rank where given so)
        wholes = whole if isinstance(whole, tuple) else (whole,) * pp
        ranks = [((held - w) / tp + w, tensors)
                 for (held, tensors), w in zip(pipeline_holdings(m, pp, virtual, schedule, tied), wholes)]
        # Adam's moments, and its fp32 step counter per parameter tensor (each stage holds its own); FSDP
        # over dp shards the rest
        over = n if e.dp_sharded else 1
        e.rank_states = [dict(params=4 * shard / over, grads=4 * shard / over,
                              optimizer=OPTIMIZER_STATE_BYTES[ledger_optimizer] * shard / over
                              + (4 * tensors if adam else 0))
                         for shard, tensors in ranks]
        e.device.update(max(e.rank_states, key=lambda d: sum(d.values())))
        shard = ranks[0][0]  # rank 0's, whose collectives the planner counts (as its sends: first_rank_hops)
        if pp > 1 and t.grad_accum > 1 and largest:
            # from the second micro-batch on, autograd computes each weight's gradient into a new tensor
            # and then adds it to .grad: one (the largest) more in backward, at the stage's peak
            e.device["buffers"] = 4 * largest / tp
        bus_dp = 2 * frac * shard * 4
        tp_comm = tp > 1 and m.hidden  # activation traffic needs the model's width
        # CPU ranks: the in-compute collectives' wait for the other rank, on the first of them counted
        # (not under sequence parallelism: its gathers and scatters have links of their own, fitted on
        # tp --sp runs in training, which hold that wait; SYNC_WAIT had put them 2x over)
        wait = cpu_costs.sync_wait_s(layout, e.compute_s) if cpu and not (tp_comm and sp) else 0.0
        if tp_comm:
            s, b, h = seq, t.micro_batch, m.hidden
            layers_here = (m.layers or 1) / pp
            per_op = (tp - 1) / tp * s * b * h * (2 if mixed else 4)  # one s*b*h activation's bus bytes
            if sp:
                # each of tp's all-reduces becomes a reduce-scatter and an all-gather (forward and
                # backward: 4 of each a layer, the same bus bytes), and each stage's first block's input
                # gradient and last block's output (the next stage's input, or the head's) are gathered
                # too: 2 a stage of rank 0's (measured on CPU ranks, 1 and 2 stages a rank)
                gathers = (4 * layers_here + 2 * (virtual if pp > 1 else 1)) * t.grad_accum
                scatters = 4 * layers_here * t.grad_accum
                if cpu:  # DTensor's redistribute per gather / scatter: host work (nbtool.plan.cpu_costs)
                    e.compute_s += hw.host_speed * cpu_costs.S_PER_SP_COLLECTIVE * (gathers + scatters)
                e.add_comm(hw, "all_gather", tp, gathers, gathers * per_op, link=SP_GATHER)
                e.add_comm(hw, "reduce_scatter", tp, scatters, scatters * per_op, link=SP_SCATTER)
                # the sequence-parallel norms' gradients, partial on each tp rank: one fp32 all-reduce a
                # step (LayerNorm's weight and bias, RMSNorm's weight; two norms a layer)
                norms = 2 * layers_here * h * (1 if m.gated_mlp else 2)
                e.add_comm(hw, "all_reduce", tp, 1, 2 * (tp - 1) / tp * 4 * norms)
                e.notes.append(f"tensor parallel {tp} with sequence parallelism: 4 all-gathers and 4 "
                               "reduce-scatters of s*b*h per layer per micro-batch (not hidden)")
            else:
                parts = 2 * layers_here if tp_split_parts is None else tp_split_parts / pp
                e.add_comm(hw, "all_reduce", tp, 2 * parts * t.grad_accum, 2 * 2 * parts * per_op * t.grad_accum,
                           wait_s=wait)
                e.notes.append(f"tensor parallel {tp}: 4 all-reduces of s*b*h per layer per micro-batch (not hidden)"
                               if tp_split_parts is None or parts == 2 * layers_here else
                               f"tensor parallel {tp}: 2 all-reduces of s*b*h per split block part per micro-batch "
                               f"(not hidden); the plan split {tp_split_parts:g} of {2 * (m.layers or 1):g} "
                               "attention and MLP parts, the rest compute whole on every rank")
            wait = 0.0
        if pp > 1:
            s, b, h = seq, t.micro_batch, m.hidden
            micro = t.grad_accum
            if h:
                # activations forward and their gradients back, each sent by one stage and received by the
                # next (the recorder counts both ends), in the activations' dtype
                hops = first_rank_hops(pp, virtual, schedule)
                p2p = 2 * micro * s * b * h * (2 if mixed else 4) * hops
                e.add_comm(hw, P2P, 2, 2 * micro * hops, p2p, wait_s=wait)  # sends and receives, as the recorder counts
            for k in tied:  # the stages' copies' gradients summed (fp32, as the weights)
                e.add_comm(hw, "all_reduce", pp, 1, 2 * (pp - 1) / pp * 4 * k)
            bubble = bubble_fraction(pp, micro, schedule, virtual)
            # theory's fraction is of the step (compute + idle): idle = compute x f / (1 - f), (p-1)
            # micro-batches' work for 1F1B, where compute x f had left out the idle's own share of the step.
            # Stages of unequal work (a head the vocabulary's width on the last): the warm-up and drain run
            # the other stages' chunks, and rank 0 waits for the slowest stage's extra every micro-batch
            others = sorted(per_rank)[:-1]
            e.bubble_s = sum(others) / len(others) * bubble / (1 - bubble) + max(per_rank) - per_rank[0]
            formula = "(p-1)/(m+p-1)" if virtual == 1 else f"of {schedule}, {virtual} stages per rank,"
            e.notes.append(f"pipeline {pp}: bubble {formula} = {bubble:.0%} of the step with m={micro} micro-batches "
                           "(more micro-batches shrink it: --microbatches M)")
            if max(r for r, _ in ranks) > 1.01 * min(r for r, _ in ranks):  # which stage to lighten, if any
                e.notes.append(f"pipeline ranks 0-{pp - 1} hold {' / '.join(format_count(r) for r, _ in ranks)} "
                               "parameters (embeddings with the first stage, final norm and head with the last); "
                               "the memory above is the largest's")
        exposed = e.comm_s
        if e.dp_sharded:
            dp_s = _fsdp_over_dp(e, hw, m, t, shard, frac, mesh_reshard, cpu, reduce_every_micro_batch)
        else:
            dp_s = e.add_comm(hw, "all_reduce", n * tp * pp, 1, bus_dp) if n > 1 else 0.0
        e.exposed_comm_s = exposed + (dp_s if cpu else max(0.0, dp_s - 2 / 3 * e.compute_s))
        _peak_phase(e, t, _adam_temporary(e, m, adam, cpu, tp), buffers_at_step=False,
                    accumulated=not e.dp_sharded or reduce_every_micro_batch)
        return e

    g = 4 if not layout.is_zero or not mixed else 2  # reduction dtype bytes
    ledger_based = not layout.is_zero or not (mixed and adam)
    shard = shard or n  # fsdp's shard group (hybrid sharding: smaller than n)
    if ledger_based:
        led = expected_ledger(layout.strategy, t.precision, numels, shard if layout.is_fsdp else n,
                              optimizer=ledger_optimizer, persistence_threshold=persistence_threshold,
                              whole=whole)
        e.device.update(params=led["params"], grads=led["grads"],
                        optimizer=led["master_params"] + led["optimizer_state"] + led["other"])
        if layout.is_zero and layout.offload and cpu:  # the host is the device: offloaded states in place
            e.notes.append("fp32 or non-Adam ZeRO: figures from the ledger theory; on CPU ranks the offloaded "
                           "states stay in the same memory")
        elif layout.is_zero and layout.offload:
            # DeepSpeed's CPU optimizer holds the fp32 partition and its states on the host; with
            # --offload both ZeRO-3's parameter partitions live there too (gathered onto the device at use)
            e.host = e.device.pop("optimizer") * hw.devices_per_node
            if layout.offload == "both" and layout.stage == 3:
                e.host += e.device.pop("params") * hw.devices_per_node
            e.notes.append("fp32 or non-Adam ZeRO with offload: the ledger theory's states, the optimizer's (and "
                           "with --offload both, ZeRO-3's parameter partitions) counted on the host")
    moments = []  # FSDP's moments in backward: ({category: bytes} over backward's start's, name)
    if layout == DDP:
        e.device["buffers"] = e.device["grads"]  # DDP's gradient buckets copy the gradients
        e.add_comm(hw, "all_reduce", n, ddp_buckets(psi * g, ddp_bucket), 2 * frac * psi * g * compress,
                   link=DDP_INFLIGHT)
    elif layout.is_fsdp:
        w = 2 if mixed else 4
        unit = _block_params(m) if m.layers else largest  # a block (the root: _root_params)
        sharded = psi - whole
        within = (shard - 1) / shard if shard > 1 else 0.0
        replicas = n // shard
        # a unit per block and the root's (embeddings, head, final norm) where the blocks are known
        units = (m.layers + 1) if m.layers else 1
        # gathers and reduce-scatters within the shard group, one per unit (two gathers a unit when it is
        # resharded after forward), gathers every micro-batch and reduce-scatters once a step (the
        # earlier micro-batches' gradients accumulate unsharded: set_requires_gradient_sync(False));
        # under HSDP the gradient shards are then all-reduced across the replicas; modules kept whole
        # all-reduce their gradients over every device
        gathers = fsdp_gathers(layout.reshard, t.grad_accum)
        reduces = t.grad_accum if reduce_every_micro_batch else 1  # each micro-batch's, or the window's once
        e.add_comm(hw, "reduce_scatter", shard, units * reduces, within * sharded * g * reduces)
        e.add_comm(hw, "all_gather", shard, units * gathers, within * sharded * w * gathers)
        if replicas > 1:
            e.add_comm(hw, "all_reduce", n, units * reduces,
                       2 * (replicas - 1) / replicas * g * sharded / shard * reduces)
        if whole:
            e.add_comm(hw, "all_reduce", n, reduces, 2 * frac * g * whole * reduces)
        # accumulating, every unit's gradients unsharded in fp32 (FSDP2 upcasts bf16 ones to the reduce
        # dtype), from the first micro-batch's backward to the last's reduce-scatters; no sharded ones yet
        accumulating = 4 * sharded if t.grad_accum > 1 and not reduce_every_micro_batch else 0.0
        # the blocks' backward (every block's activations alive): FSDP2 holds the unit being computed and
        # the one prefetched; gloo (CPU ranks) gathers into a flat copy of the output, alive as the
        # prefetch runs
        blocks = (3 if cpu and shard > 1 else 2) * w * unit
        if not layout.reshard:
            e.device["buffers"] = w * psi + accumulating  # every unit stays gathered from forward to backward
        elif not m.layers:
            e.device["buffers"] = blocks + accumulating
        else:
            # nbtool reshards the root unit after forward too (it passes the flag; torch's default keeps
            # the root's gathered): as the loss's backward starts nothing is gathered. The root (embeddings,
            # final norm, head) is gathered as the head's backward starts, the loss's log_softmax output and
            # nll's gradient gone (8 of its 12 s b V), into the collective's flat output and copied out of
            # it (2 copies), and stays gathered until its post-backward at backward's end (measured with
            # FSDPMemTracker, an 8192-word head on CPU ranks: the peak there, 49.0 MiB; counted as three
            # units at every activation's moment it had read +24%)
            e.device["buffers"] = accumulating
            root = _root_params(m)
            left = act - 8 * (t.seq or m.seq or 0) * t.micro_batch * (m.vocab or 0) if act else 0.0
            moments += [({"buffers": 2 * w * root + accumulating, "activations": left}, "head's backward"),
                        ({"buffers": w * root + blocks + accumulating, "activations": left}, "blocks' backward")]
            if shard > 1:
                # the last block's reduce-scatter, its activations and gathered weights gone: the next unit
                # prefetched, its gradients cast to the reduction dtype (still there while casting), the
                # output shard, and on CPU ranks gloo's copy of the input. The larger moment in bf16, whose
                # weights and activations halve and the reduction's fp32 does not (measured, wide shape: 12
                # units of bf16 weight against the 8 counted at backward's start)
                reduce = w * unit + g * unit + max(w * unit, g * unit / shard + (g * unit if cpu else 0))
                moments.append(({"buffers": w * root + reduce + accumulating,
                                 "activations": (m.layers - 1) * _act_per_layer(m, t, 1, False) if act else 0.0},
                                "first reduce-scatter"))
    else:  # DeepSpeed ZeRO
        stage = layout.stage
        if not ledger_based:
            if stage == 1:
                e.device.update(params=2 * psi, grads=2 * psi + 4 * psi / n, optimizer=12 * psi / n)
            elif layout == ZERO2:
                e.device.update(params=2 * psi, grads=6 * psi / n, optimizer=12 * psi / n)
            elif layout == ZERO2_OFFLOAD:
                e.device.update(params=2 * psi)
                # DeepSpeed's estimator: 4 bytes per parameter per process (the fp32 copy at
                # start-up) or the 16-byte states, whichever is larger, x 1.5 buffer factor
                e.host = psi * max(4 * hw.devices, 16) * 1.5
            elif layout == ZERO3:
                e.device.update(params=2 * psi / n, grads=4 * psi / n, optimizer=12 * psi / n, buffers=4 * largest)
            elif layout == ZERO3_OFFLOAD_OPTIMIZER:
                e.device.update(params=2 * psi / n, buffers=4 * largest)
                e.host = psi * 16 * 1.5 / hw.nodes
            elif layout == ZERO3_OFFLOAD:
                e.device.update(buffers=4 * largest)
                e.host = psi * 18 * 1.5 / hw.nodes
            e.estimator_states = _owned(e.device)
        # the contiguous reduce bucket; ZeRO-1/2 overlapping the reduction with backward double-buffer it
        # (measured on CPU ranks: 3.77 GiB with --overlap-comm against 1.91 without, 5e8 fp32 elements each)
        e.device["buffers"] = e.device.get("buffers", 0) + reduce_bucket * g * (2 if overlap_comm and stage < 3 else 1)
        w = 2 if mixed else 4
        buckets = math.ceil(psi / reduce_bucket)
        if stage < 3:  # gradients all-reduced (DeepSpeed's bucket all-reduce), updated partitions gathered
            e.add_comm(hw, "all_reduce", n, buckets, 2 * frac * psi * g)
            e.add_comm(hw, "all_gather", n, math.ceil(psi / ALLGATHER_BUCKET), frac * psi * w)
        else:  # tensors at most the persistence threshold stay whole: gathered once, after the step
            persistent = [k for k in m.numels if k <= persistence_threshold]
            gathered = psi - sum(persistent)
            # measured: gathered once when they fit the reuse limit (kept for backward), else twice
            regather = gathered > reuse_limit or not m.numels
            e.add_comm(hw, "reduce_scatter", n, buckets, frac * psi * g)
            # one all-gather per parameter tensor each time it is fetched (measured: 70 a step for the
            # tutorial model's 70 tensors); without the tensors' sizes, 2 a layer
            fetches = ((2 if regather else 1) * (len(m.numels) - len(persistent)) + len(persistent)
                       if m.numels else 2 * (m.layers or 1))
            # issued ahead (prefetched) and waited on: their own link where known (CPU ranks, measured)
            e.add_comm(hw, "all_gather", n, fetches, frac * ((2 if regather else 1) * w * gathered + w * sum(persistent)),
                       link=ZERO3_FETCH)
            # in memory, prefetching keeps them as if reused (measured, wide shape: reuse distance 0 with
            # the default prefetch bucket peaks as the defaults do), up to DeepSpeed's live-parameter limit
            held = not regather or (prefetch_bucket != 0 and gathered <= REUSE_LIMIT)
            # kept gathered for backward, twice over: DeepSpeed gathers a prefetch bucket's shards into
            # one flat buffer, then assembles each parameter from it with torch.cat (a copy), and the
            # flat buffer stays alive until backward's end (measured, 2 CPU ranks, wide shape: both
            # 13.5 MiB, alive together from forward's first gather through the last backward matmul;
            # this counted only the others' shards, (n-1)/n of one, 23 of 80 MiB short beyond the bucket)
            kept = 2 * w * gathered if held else 0
            e.device["buffers"] += kept
            # backward's end, activations and gathered parameters gone: DeepSpeed flattens the bucket's
            # gradients into one tensor (torch.cat, a copy) to reduce-scatter them, and gloo (CPU ranks)
            # clones that input. The peak where parameters are fetched again for backward, unprefetched
            # (measured, wide shape, stage3_max_reuse_distance and stage3_prefetch_bucket_size 0: 2 x 14.3
            # MiB, the rest of the peak beyond the states and the bucket exactly; 23% short without it)
            flat = g * min(psi, reduce_bucket) * (2 if cpu else 1)
            if flat > e.device.get("activations", 0) + kept:
                e.device.update(activations=0.0, buffers=e.device["buffers"] - kept + flat)
                e.peak_phase = "last reduce-scatter"
        # DeepSpeed's one scalar all-reduce a step (the gradients' overflow check; measured: 4 bytes,
        # 8 in stage 3), as slow as a small all-reduce can be on CPU ranks
        e.add_comm(hw, "all_reduce", n, 1, 2 * frac * (8 if stage == 3 else 4))
        if layout.offload:
            moved = (4 + w) * psi / n  # fp32 gradients out, parameters (16-bit where mixed) back, per device
            if layout.offload == "both":
                moved += 2 * w * psi / n  # parameters fetched from the host for forward and backward
            e.offload_s = moved / hw.host_link_bw
            e.notes.append(f"offload moves {format_gb(moved)} per device per step over the host link")
    # gloo's collectives on CPU ranks share the cores with compute: the recorder shows the thread
    # blocked for about all of their time (exposed = busy for fsdp, zero1/2, tp), so none is hidden
    e.exposed_comm_s = e.comm_s if cpu else max(0.0, e.comm_s - 2 / 3 * e.compute_s)
    if layout.stage == 2:
        # ZeRO-2 fills its gradient partition as the bucket is reduced, at backward's end when the bucket
        # holds every gradient, and lets go of the bucket after backward (live blocks at the peak, wide
        # shape on CPU ranks: the bucket, Adam's moments and backward's first matmul outputs; counting
        # the partition at backward's start put the peak beyond the bucket 8.0-9.3% over on three shapes,
        # every run). Adam's temporaries are over the flat fp32 partition: on CPU ranks its square root
        # and quotient, one partition each (measured); on GPUs a foreach square root of the second moments
        _peak_phase(e, t, 0.0 if layout.offload or not adam else (2 if cpu else 1) * 4 * psi / n,
                    buffers_at_step=False)
    elif layout.is_zero:  # DeepSpeed's estimator counts its own buffers, whatever the moment
        e.states = _owned(e.device)
    else:  # DDP's buckets stay; FSDP's gathered units and copies are gone by the optimizer step
        _peak_phase(e, t, _adam_temporary(e, m, adam, cpu, shard if layout.is_fsdp else 1),
                    buffers_at_step=layout == DDP, moments=moments,
                    accumulated=not layout.is_fsdp or reduce_every_micro_batch)
    if layout.is_zero:
        # what the ranks own over a step is the ledger theory's (the recorder's ledger to the byte, bf16
        # and offload included: tests/test_strategies.py), also where the peak's figures are DeepSpeed's
        # estimator's (mixed precision with Adam: its full 16-bit gradients, counted at their moment) or
        # leave offload's host-side states unsplit (fp32)
        led = expected_ledger(layout.strategy, t.precision, numels, n, optimizer=ledger_optimizer,
                              persistence_threshold=persistence_threshold, offload=layout.offload)
        e.states = dict(params=led["params"], grads=led["grads"],
                        optimizer=led["master_params"] + led["optimizer_state"] + led["other"])
    return e


def fsdp_gathers(reshard: bool, micro_batches: int, pipeline: bool = False) -> int:
    """All-gathers of each FSDP unit a step: one a micro-batch (two when resharded after forward, the
    unit gathered again for backward); in a pipeline, whose units stay gathered from the stage's first
    backward, each forward before it or after one (resharded after forward) and each backward after a
    forward gathers: M + 1 (measured: 15 for 3 units, M = 4), or 1 without resharding."""
    if pipeline:
        return micro_batches + 1 if reshard else 1
    return (2 if reshard else 1) * micro_batches


def _fsdp_over_dp(e: Estimate, hw: Hardware, m: ModelShape, t: Training, elements: float, frac: float,
                  reshard: bool, cpu: bool, every_micro_batch: bool = False) -> float:
    """fsdp --tp/--pp's data parallelism on a rank holding ``elements`` (its stages' tp shards): a unit
    per block and the stage's root, each gathered in the compute dtype and its gradients
    reduce-scattered in fp32 over dp (MixedPrecisionPolicy's reduce_dtype), once a step (the earlier
    micro-batches' accumulate unsharded) or, ``every_micro_batch`` (not in a pipeline), once a
    micro-batch; returns their seconds. Counts the gathered weights and the accumulating gradients
    they hold at the peak as buffers."""
    w = 2 if t.precision in ("bf16", "fp16") else 4
    units = (m.layers / e.pp + 1) if m.layers else 1
    gathers = fsdp_gathers(reshard, t.grad_accum, e.pp > 1)
    if e.pp > 1:
        # torch's pipelining keeps every unit gathered from a stage's first backward to the step's
        # end, and its unsharded gradients (fp32) accumulating
        e.device["buffers"] = e.device.get("buffers", 0) + (w + 4) * elements
    else:
        unit = (_block_params(m) / e.tp) if m.layers else elements
        # the unit computed and the one prefetched (gloo, CPU ranks: its flat copy of the output too), or
        # every unit between forward and backward without resharding; accumulating, every unit's
        # gradients unsharded in fp32 (as fsdp's)
        gathered = (3 if cpu and frac else 2) * w * unit if reshard else w * elements
        accumulating = 4 * elements if t.grad_accum > 1 and not every_micro_batch else 0.0
        e.device["buffers"] = e.device.get("buffers", 0) + gathered + accumulating
    reduces = t.grad_accum if every_micro_batch and e.pp == 1 else 1
    if not frac:
        return 0.0
    return (e.add_comm(hw, "reduce_scatter", e.dp, units * reduces, frac * 4 * elements * reduces)
            + e.add_comm(hw, "all_gather", e.dp, units * gathers, frac * w * elements * gathers))


def ddp_buckets(grad_bytes: float, cap: float | None = None) -> int:
    """DDP's gradient buckets a step: torch's default (``cap`` None) caps the first at 1 MiB, so that
    backward's first gradients leave early, and the others at 25 MiB; an explicit cap applies to all
    (measured: 2 all-reduces a step for 1.5-15 MB of gradients under the default, 1 with a --bucket-mb that
    holds them all: the advice test in tests/test_metrics.py)."""
    first, cap = (DDP_FIRST_BUCKET, DDP_BUCKET) if cap is None else (cap, cap)
    return 1 + math.ceil(max(0.0, grad_bytes - first) / cap)


def sequence(m: ModelShape, t: Training) -> tuple[int, bool]:
    """The sequence length the compute term counts, and whether it is assumed (``DEFAULT_SEQ``:
    neither the training setup nor the model gives one). A run's calibration counts with the same,
    so a run calibrated on itself fits by construction."""
    seq = t.seq or m.seq
    return seq or DEFAULT_SEQ, seq is None


def _adam_temporary(e: Estimate, m: ModelShape, adam: bool, cpu: bool, split: int) -> float:
    """Bytes torch's Adam allocates inside its step: on GPUs its foreach kernels take the square root of
    every second moment at once (one fp32 copy of the parameters a device owns); on CPU ranks, one
    tensor at a time, the largest one's square root and its quotient (measured: 2-3 of them alive in
    the step's peak). ``split``: how many ways each tensor is sharded (fsdp, tp)."""
    if not adam:
        return 0.0
    if not cpu:
        return e.device.get("optimizer", 0) / 2
    return 2 * 4 * (max(m.numels) if m.numels else (m.largest_layer or 0)) / split


def _owned(device: dict) -> dict:
    """What a device owns over a step: the ledger's categories of ``device``."""
    return {k: device.get(k, 0) for k in ("params", "grads", "optimizer")}


def _peak_phase(e: Estimate, t: Training, temporary: float, buffers_at_step: bool,
                moments: list = (), accumulated: bool = True) -> None:
    """Set ``e.device`` to the largest of these moments of a step (DDP, FSDP, tp/pp: torch's optimizers,
    gradients set to None by zero_grad; ZeRO-2, whose gradient partition is made at backward's end):

    - backward's start: every activation saved, no gradient yet (with gradient accumulation, the
      earlier micro-batches' gradients are there);
    - the optimizer step: activations gone, gradients there, the buffers only where they persist
      (``buffers_at_step``: DDP's buckets; not FSDP's gathered units, resharded after backward, nor
      a pipeline's gradient being added, nor ZeRO-2's reduce bucket), and the optimizer's
      ``temporary`` (_adam_temporary);
    - FSDP's moments in backward (``moments``: what each holds other than backward's start, by
      category, and its name): the head's backward, the blocks' backward and the first reduce-scatter.

    ``accumulated``: the earlier micro-batches' gradients are in the owned ones (not FSDP's: it
    accumulates them unsharded, in its buffers, and reduce-scatters them after the last micro-batch).
    """
    e.states = _owned(e.device)
    start = {k: v for k, v in e.device.items() if k != "grads" or (t.grad_accum > 1 and accumulated)}
    step = {k: v for k, v in e.device.items() if k != "activations" and (k != "buffers" or buffers_at_step)}
    if temporary:
        step["buffers"] = step.get("buffers", 0) + temporary
    candidates = [(start, "backward start"), (step, "optimizer step")] + [({**start, **over}, name)
                                                                         for over, name in moments]
    e.device, e.peak_phase = max(candidates, key=lambda d: sum(d[0].values()))
