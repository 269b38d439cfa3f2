"""Memory and throughput planning: which layouts of target and drafter processes fit a GPU, and
how fast they should train, before anything heavy loads.

Memory is the peak `torch.cuda.max_memory_allocated` of each process, counted tensor by tensor:

Target process (frozen, no grad, no KV cache):
- weights: every parameter in the target dtype (bf16);
- prefill transient: one decoder layer's tensors at a time (eval forward) per token: residual,
  normed input, attention output and o_proj output (4 H), q before and after norm/RoPE, k and v
  (2 q + 2 kv), the MLP's gate and up (2 x the active MLP width: top-k experts for MoE);
- taps: K x H per token twice (each tapped layer's output, then their concatenation).

Drafter process (bf16 weights, float32 masters and Adam moments in `MasterWeightAdamW`):
- state: 2 (bf16 weight) + 4 (master) + 8 (moments) = 14 B/param, plus 4 B of float32 gradient sums
  when micro-batches accumulate (train/optim/grads.py: allocated once, alive through every forward; the
  bf16 gradients live only from a backward to the sum's add after it). The optimizer streams
  28 B/param per update (train/optim/optimizer.py), but holds 14-18;
- the target's frozen embedding and lm_head (bf16; shared with the target when colocated);
- activations saved for backward, per block token (N x B per sequence) and drafter layer: 4 H
  (residual, normed input, post-attention residual and norm), 3 q (q, normed q, attention
  output), 3 kv (k, normed k, v), 3 I (gate, up, their product) and 2 q for K/V repeated to the
  query heads before flex (`attention.attend`); per context position and layer 3 kv + 2 q;
  plus block embeddings, final norm in and out (3 H per block token), fc and hidden_norm outputs
  (2 H per position), and the loss's saved float32 gradient (H per block token);
- the loss chunk: `loss.chunk_tokens` rows of bf16 logits and their gradient, 4 B x V per row
  (train/loss/objective.py, compiled);
- taps of the micro-batch (and `topology.max_in_flight` of them when disaggregated).

Throughput scales the component rates measured on one H200 (docs/PERF.md section 3.1, 2026-12-01)
by FLOPs at equal MFU: the drafter step at the paper shapes, 22.9K tok/s (Qwen3-8B drafter,
S 3072, N 512, B 16), and the tapped target prefill, 42.6K tok/s (Qwen3-8B, 4 x 3072, compiled
layers). Colocated, a GPU runs both in turn; disaggregated, the slower stage sets the pace (the
2-GPU pipeline measured 99 % of it, PERF.md 3.1).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_train.config import RunConfig, block_size_of
from dflash_train.model.drafter.heads.architectures import head, head_settings
from dflash_train.model.drafter.config import DrafterConfig, drafter_config_from_target
from dflash_train.model.drafter.shape import BASE_HEAD

GIB = 2**30
BF16 = 2
DRAFTER_STATE_BYTES = 2 + 4 + 8  # bf16 weight, float32 master, two float32 Adam moments
GRAD_BYTES = 4  # float32 gradient sums (train/optim/grads.py), which exist only when micro-batches accumulate
GROUP_STYLES = [(size, parallel) for size in (2, 4, 8) for parallel in ("tensor", "pipeline")]
"""Target groups `layouts` tries when one target does not fit a GPU (topology.target_group_size,
topology.target_parallel)."""
RESERVE_GIB = 4.0
"""Left free on each GPU: CUDA context, NCCL buffers, allocator fragmentation."""
H200_GIB = 139.8  # 141 GB, the memory torch reports on the lent H200s (~139 GiB)
MEASURED_DRAFTER_TOK_S = 22_900.0  # PERF.md 3.1: drafter step, paper config, session 4
MEASURED_TARGET_TOK_S = 42_600.0  # PERF.md 3.1: target tapped prefill, Qwen3-8B shape, 4 x 3072

QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                tie_word_embeddings=False, rope_theta=1e6, max_position_embeddings=40960)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1e6, max_position_embeddings=40960)
LLAMA_3_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                   rope_theta=500000.0, max_position_embeddings=131072)
KNOWN_TARGETS = {"qwen3-8b": QWEN3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B, "llama-3.3-70b": LLAMA_3_70B}


# ---------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class TargetShape:
    """What planning needs of a target: its text config and parameter counts."""

    config: object
    total_params: int
    active_params: int
    """Per token: experts outside the top-k excluded."""
    embedding_params: int
    """Input embedding plus an untied lm_head."""

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    @property
    def vocab(self) -> int:
        return self.config.vocab_size

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.hidden // self.config.num_attention_heads

    @property
    def q_width(self) -> int:
        return self.config.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return (getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads) * self.head_dim

    @property
    def active_mlp_width(self) -> int:
        """Per token: the dense MLP width, or top-k expert widths plus any shared expert."""
        cfg = self.config
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        if not experts:
            return cfg.intermediate_size
        per_expert = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        return cfg.num_experts_per_tok * per_expert + (getattr(cfg, "shared_expert_intermediate_size", 0) or 0)

    @property
    def active_mlp_params(self) -> int:
        """Per token and layer, the MLP parameters it runs through: the dense MLP's gate, up and
        down, or the router plus the active experts' (and any shared expert's)."""
        experts = getattr(self.config, "num_experts", None) or getattr(self.config, "num_local_experts", None) or 0
        return 3 * self.hidden * self.active_mlp_width + self.hidden * experts


def load_target_config(spec: str):
    """A known shape name (`KNOWN_TARGETS`), an HF model directory or a config.json file."""
    from transformers import AutoConfig

    if spec.lower() in KNOWN_TARGETS:
        values = dict(KNOWN_TARGETS[spec.lower()])
        return AutoConfig.for_model(values.pop("model_type"), **values)
    path = Path(spec).expanduser()
    if path.is_file():
        values = json.loads(path.read_text())
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if path.is_dir():
        return AutoConfig.from_pretrained(path, local_files_only=True)
    raise FileNotFoundError(f"target {spec!r}: not a known shape ({', '.join(KNOWN_TARGETS)}), "
                            "an HF model directory or a config.json")


ANALYTIC_TYPES = ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral")


def _is_moe_layer(cfg, index: int) -> bool:
    if cfg.model_type == "mixtral":
        return True
    if cfg.model_type != "qwen3_moe" or index in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    return cfg.num_experts > 0 and (index + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0


def _analytic_counts(cfg) -> tuple[int, int, int]:
    """(total, expert, embedding) parameters of a Llama / Qwen3 / Mixtral-style decoder: attention
    (+ per-head q/k norms in Qwen3), a SwiGLU MLP or routed SwiGLU experts with a router, two norms."""
    h = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv + h if getattr(cfg, "attention_bias", False) else 0)
    attention += 2 * head_dim if cfg.model_type.startswith("qwen3") else 0
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    expert_width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    total = expert = 0
    for i in range(cfg.num_hidden_layers):
        total += attention + 2 * h
        if _is_moe_layer(cfg, i):
            expert += experts * 3 * h * expert_width
            total += h * experts
        else:
            total += 3 * h * cfg.intermediate_size
    embedding = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return total + expert + embedding + h, expert, embedding


def target_shape(config) -> TargetShape:
    """Parameter counts: by formula for the common decoders (`ANALYTIC_TYPES`), else from the model
    built on the meta device (exact for any architecture transformers knows, nothing allocated,
    but a minute of CPU for a large config on a busy machine)."""
    text = getattr(config, "text_config", None) or config
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    if text.model_type in ANALYTIC_TYPES:
        total, expert, embeddings = _analytic_counts(text)
    else:
        total, expert, embeddings = _meta_counts(text)
    inactive = round(expert * (1 - text.num_experts_per_tok / experts)) if experts else 0
    return TargetShape(text, total, total - inactive, embeddings)


def _meta_counts(text) -> tuple[int, int, int]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text)
    total = expert = 0
    for name, p in model.named_parameters():
        total += p.numel()
        expert += p.numel() if ".experts." in name and "shared" not in name else 0
    embeddings = sum(p.numel() for p in {id(m.weight): m.weight for m in
                                         (model.get_input_embeddings(), model.get_output_embeddings())}.values())
    return total, expert, embeddings


@dataclass(frozen=True)
class RunShape:
    """The run settings memory and speed depend on (from a `RunConfig`)."""

    drafter_layers: int = 5
    block_size: int = 16
    num_anchors: int = 512
    seq_len: int = 3072
    micro_batch: int = 1
    grad_accum: int = 1
    num_taps: int = 5
    chunk_tokens: int = 2048
    max_in_flight: int = 2
    taps_bytes: int = BF16
    arch: str = BASE_HEAD
    """The drafter's head (model/drafter/heads/architectures.py): its own parameters and drafted tokens count."""
    head_settings: tuple[tuple[str, object], ...] = ()
    """The heads' `drafter.*` settings, as (field, value)."""

    @classmethod
    def from_run_config(cls, cfg: RunConfig, drafter_processes: int = 1) -> "RunShape":
        accum = max(1, cfg.train.seqs_per_step // (cfg.train.micro_batch * drafter_processes))
        return cls(cfg.drafter.num_layers, block_size_of(cfg.drafter), cfg.train.num_anchors, cfg.data.max_len,
                   cfg.train.micro_batch, accum, cfg.drafter.num_taps, cfg.loss.chunk_tokens,
                   cfg.topology.max_in_flight, arch=cfg.drafter.arch,
                   head_settings=tuple(head_settings(cfg.drafter).items()))

    @property
    def block_tokens(self) -> int:
        return self.num_anchors * self.block_size

    @property
    def drafted(self) -> int:
        """Tokens a block drafts: the rows the loss scores per block (the head's)."""
        return head(self.arch).module.drafted(self.block_size)


def drafter_config(shape: TargetShape, run: RunShape) -> DrafterConfig:
    return drafter_config_from_target(shape.config, num_layers=run.drafter_layers, block_size=run.block_size,
                                      mask_token_id=0, num_taps=run.num_taps, arch=run.arch,
                                      head_settings=dict(run.head_settings))


def drafter_params(d: DrafterConfig) -> int:
    """Trainable parameters: layers (attention, q/k norms, SwiGLU MLP, two norms), fc, two norms, and the
    head's own (`Head.parameters`: DFlash 2's convolutions and codebooks, DSpark's Markov tables, ...)."""
    q, kv, h = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden_size
    attention = h * q * 2 + h * kv * 2 + 2 * d.head_dim + (q + 2 * kv + h if d.attention_bias else 0)
    layer = attention + 3 * h * d.intermediate_size + 2 * h
    return d.num_layers * layer + d.num_taps * h * h + 2 * h + head(d.arch).parameters(d)


# ---------------------------------------------------------------------------------------------
# Memory


@dataclass
class Memory:
    """Named parts of one process's peak, in bytes."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total_gib(self) -> float:
        return sum(self.parts.values()) / GIB

    def describe(self) -> str:
        inner = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items())
        return f"{self.total_gib:.1f} GiB ({inner})"


def _taps_bytes(shape: TargetShape, run: RunShape) -> float:
    return run.micro_batch * run.seq_len * run.num_taps * shape.hidden * run.taps_bytes


def target_memory(shape: TargetShape, run: RunShape, in_flight: int = 0, group: int = 1,
                  parallel: str = "tensor") -> Memory:
    """A target process: weights, one layer's prefill tensors, the taps (plus `in_flight` sent
    batches not yet received). In a group of `group` ranks the decoder layers are split: sharded
    (`tensor`: 1/group of every layer's weights and of its q, kv and MLP tensors) or staged
    (`pipeline`: the largest stage's layers, whole); embedding and lm_head stay on every rank."""
    tokens = run.micro_batch * run.seq_len
    split = group if parallel == "tensor" else 1
    per_token = 4 * shape.hidden + (2 * shape.q_width + 2 * shape.kv_width + 2 * shape.active_mlp_width) / split
    layer_weights = shape.total_params - shape.embedding_params
    held = 1 / group if parallel == "tensor" else math.ceil(shape.layers / group) / shape.layers
    return Memory({"weights": (layer_weights * held + shape.embedding_params) * BF16,
                   "prefill": tokens * per_token * BF16, "taps": _taps_bytes(shape, run) * (2 + in_flight)})


def drafter_memory(shape: TargetShape, run: RunShape, with_embeddings: bool = True, in_flight: int = 1) -> Memory:
    """A drafter process (see the module doc); `with_embeddings` False when a colocated target
    already holds them."""
    d = drafter_config(shape, run)
    q, kv, h = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden_size
    repeated = 2 * q if d.num_kv_heads < d.num_heads else 0  # K/V expanded to the query heads
    block, context = run.micro_batch * run.block_tokens, run.micro_batch * run.seq_len
    per_block_token = d.num_layers * (4 * h + 3 * q + 3 * kv + 3 * d.intermediate_size + repeated) + 3 * h
    per_context = d.num_layers * (3 * kv + repeated) + 2 * h
    state = DRAFTER_STATE_BYTES + (GRAD_BYTES if run.grad_accum > 1 else 0)
    parts = {"state": drafter_params(d) * state}
    if with_embeddings:
        parts["embeddings"] = shape.embedding_params * BF16
    parts["activations"] = (block * per_block_token + context * per_context) * BF16 + block * h * 4
    loss_rows = min(run.chunk_tokens, run.num_anchors * run.drafted)
    parts["loss_chunk"] = loss_rows * shape.vocab * 2 * BF16
    parts["taps"] = _taps_bytes(shape, run) * in_flight
    return Memory(parts)


def colocated_memory(shape: TargetShape, run: RunShape) -> Memory:
    """Target and drafter in one process: the target's prefill tensors are gone before the drafter
    step peaks, the taps of the micro-batch stay, the embeddings are the target's."""
    target = target_memory(shape, run)
    drafter = drafter_memory(shape, run, with_embeddings=False)
    parts = {"target_weights": target.parts["weights"]}
    parts.update(drafter.parts)
    return Memory(parts)


# ---------------------------------------------------------------------------------------------
# Throughput and layouts


def drafter_flops(d: DrafterConfig, run: RunShape) -> float:
    """One sequence's drafter train step (bench/flops.py conventions: trainable matmuls 3x forward,
    lm_head and fc 2x, attention over the visible mask entries)."""
    q, kv, h = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.hidden_size
    layer = 2 * h * q + 2 * h * kv + 3 * h * d.intermediate_size
    block, s = run.block_tokens, run.seq_len
    visible = block * ((s - 1) / 2 + run.block_size)
    trained = d.num_layers * (2 * block * layer + 2 * s * 2 * h * kv + 4 * visible * q)
    frozen = 2 * run.num_anchors * run.drafted * h * d.vocab_size + 2 * s * d.num_taps * h * h
    return 3 * trained + 2 * frozen


def target_flops(shape: TargetShape, run: RunShape) -> float:
    """One sequence's tapped prefill: layers up to the last tap (active parameters) and causal attention."""
    d = drafter_config(shape, run)
    run_layers = max(d.target_layer_ids) + 1
    layer_params = (shape.active_params - shape.embedding_params) / shape.layers
    s = run.seq_len
    return run_layers * (2 * s * layer_params + 2 * s * s * shape.q_width)


PAPER_RUN = RunShape()


@functools.cache
def _paper_shape() -> TargetShape:
    """Qwen3-8B: the shape the measured rates belong to."""
    return target_shape(load_target_config("qwen3-8b"))


def rates(shape: TargetShape, run: RunShape) -> tuple[float, float]:
    """(drafter, target) tokens/s of one GPU each, the measured H200 rates scaled by FLOPs."""
    paper = _paper_shape()
    drafter = MEASURED_DRAFTER_TOK_S * drafter_flops(drafter_config(paper, PAPER_RUN), PAPER_RUN) / run.seq_len \
        / (drafter_flops(drafter_config(shape, run), run) / run.seq_len)
    target = MEASURED_TARGET_TOK_S * target_flops(paper, PAPER_RUN) / target_flops(shape, run)
    return drafter, target


@dataclass(frozen=True)
class Layout:
    name: str
    gpus: int
    target_gib: float
    drafter_gib: float
    fits: bool
    tokens_per_s: float
    target_ranks: int = 0  # disaggregated layouts
    group: int = 1
    parallel: str = "tensor"

    def overrides(self) -> str:
        """The config that runs this layout."""
        if not self.target_ranks:
            return "topology.mode=colocated"
        grouped = (f" topology.target_group_size={self.group} topology.target_parallel={self.parallel}"
                   if self.group > 1 else "")
        return f"topology.mode=disaggregated topology.target_ranks={self.target_ranks}{grouped}"

    def describe(self, gpu_gib: float) -> str:
        verdict = "fits" if self.fits else f"does not fit {gpu_gib - RESERVE_GIB:.0f} GiB usable"
        per = (f"{self.target_gib:.1f} GiB per GPU" if self.name.startswith("colocated") else
               f"target {self.target_gib:.1f} GiB, drafter {self.drafter_gib:.1f} GiB")
        return f"{self.name:<28} {self.gpus} GPU  {per:<40} {verdict:<24} ~{self.tokens_per_s / 1e3:.1f}K tok/s"


def layouts(shape: TargetShape, run: RunShape, gpus: int, gpu_gib: float = H200_GIB) -> list[Layout]:
    """Colocated on all `gpus` and every disaggregated split T + D = gpus, smallest fitting first
    (then the fastest); one process per GPU."""
    usable = gpu_gib - RESERVE_GIB
    drafter_rate, target_rate = rates(shape, run)
    out = []
    colo = colocated_memory(shape, run).total_gib
    out.append(Layout("colocated", gpus, colo, colo, colo <= usable,
                      gpus / (1 / drafter_rate + 1 / target_rate)))
    dm = drafter_memory(shape, run, in_flight=run.max_in_flight).total_gib
    single = target_memory(shape, run, in_flight=run.max_in_flight).total_gib
    for group, parallel in [(1, "tensor")] + ([] if single <= usable else GROUP_STYLES):
        tm = single if group == 1 else target_memory(shape, run, run.max_in_flight, group, parallel).total_gib
        how = "" if group == 1 else f" ({'TP' if parallel == 'tensor' else 'PP'} {group})"
        for t in range(group, gpus, group):  # whole groups; ideal scaling within a group (not measured)
            out.append(Layout(f"disaggregated {t}T+{gpus - t}D{how}", gpus, tm, dm, max(tm, dm) <= usable,
                              min(t * target_rate, (gpus - t) * drafter_rate), t, group, parallel))
    return sorted(out, key=lambda lay: (not lay.fits, lay.gpus, -lay.tokens_per_s))


def smallest_fitting(shape: TargetShape, run: RunShape, max_gpus: int, gpu_gib: float = H200_GIB) -> list[Layout]:
    """The fitting layouts of the fewest GPUs (1..max_gpus), fastest first; empty when none fits."""
    for gpus in range(1, max_gpus + 1):
        fitting = [lay for lay in layouts(shape, run, gpus, gpu_gib) if lay.fits]
        if fitting:
            return fitting
    return []


def weights_need_gpus(shape: TargetShape, gpu_gib: float = H200_GIB) -> int:
    """GPUs a target group (tensor-parallel or pipeline stages) needs for the weights alone."""
    return math.ceil(shape.total_params * BF16 / GIB / (gpu_gib - RESERVE_GIB))
