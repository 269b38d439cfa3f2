"""The pieces `train()` assembles: target, drafter, samples, held-out batches, resume.

Kept apart from the loop so `loop.py` reads top to bottom; every function here is plain setup
with no hidden state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train import atomic, cache
from dflash_train.config import RunConfig, block_size_of, derived_gamma
from dflash_train.data.anchors import all_anchors
from dflash_train.data.dataset import load_samples, prepare_samples, split_held_out
from dflash_train.data.dataset import prepare_tapped as prepare_tapped_samples
from dflash_train.data.shards import ShardReader
from dflash_train.data.text import has_chat_template, resolve_data_format
from dflash_train.eval.prompt_sets import check_prompt_sets
from dflash_train.model.drafter.config import DrafterConfig, drafter_config_from_target
from dflash_train.model.drafter.attention import PersistentMasks
from dflash_train.model.drafter.heads.architectures import build_drafter, head_settings
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.target.target import norm_factor, resolve_mask_token_id
from dflash_train.model.target.subset import TargetSubset
from dflash_train.train.feed.batching import BatchPlan, MicroBatch, Sample, padded_length
from dflash_train.train.feed.sources import CollateArgs, Rows
from dflash_train.train.feed.packed import PackedRows, place
from dflash_train.train.feed.taps import FINAL_HIDDEN, StoredRows, TapsSpec, pick_entries
from dflash_train.train.parallel.parallelize import parallelize, resolve_backend, resolve_compile
from dflash_train.train.parallel.topology import Topology
from dflash_train.fp8 import FP8_ALIGN, resolve_precision
from dflash_train.train.loss.objective import LossMix
from dflash_train.train.loss.vocab import vocab_subset
from dflash_train.train.optim.optimizer import build_optimizer, param_dtype
from dflash_train.train.step import StepContext

PAD_MULTIPLE = 64  # uncompiled runs pad lengths to this multiple; compiled runs pad to max_len (static)


@dataclass(frozen=True)
class Data:
    """The run's samples; `stored` holds (train, held-out) per-sample target tensors when the data
    came with them (regenerate + tap, or offline shards), else None."""

    train: list[Sample]
    held_out: list[Sample]
    stored: tuple[Rows, Rows] | None = None


def load_data(cfg: RunConfig, topo: Topology, target, layer_ids, spec: TapsSpec, work_dir: Path, log,
              heartbeat=None, group=None) -> Data:
    """Samples from shards (offline), from a regenerate + tap pass (one colocated process), or
    tokenized conversations (prepared once by the main drafter rank, read by each node from its
    own `work_dir`)."""
    if topo.reads_shards:
        return samples_from_shards(cfg, layer_ids, spec, log)
    if taps_from_regeneration(cfg, topo):
        return prepare_tapped(cfg, target, layer_ids, spec, work_dir, log, heartbeat)
    return Data(*load_or_build_samples(cfg, target, topo, work_dir, log, heartbeat=heartbeat, group=group))


def target_subset(cfg: RunConfig, topo: Topology, log) -> TargetSubset | None:
    """The target weights this rank holds: all of them (None) where it runs the target, else (a
    drafter rank of a disaggregated run: target ranks send it the taps) the embedding, lm_head and
    what `init_drafter` copies. The main drafter rank keeps the whole target when `data.regenerate`
    makes it generate the training responses itself (`load_or_build_samples`)."""
    if not topo.has_target_ranks or topo.is_target:
        return None
    if cfg.data.regenerate and topo.is_main:
        groups = cfg.topology.target_group_size
        how = (f"`torchrun --nproc-per-node={groups} -m dflash_train regenerate --out R.jsonl "
               f"topology.target_group_size={groups}` (target groups, as training's)" if groups > 1
               else "`dflash-train regenerate --out R.jsonl`")
        log("target: the whole target on the main drafter rank: data.regenerate generates the responses here; "
            f"to hold only its embedding and lm_head, regenerate first with {how} and train with "
            "data.train=R.jsonl data.regenerate=false")
        return None
    copies = cfg.drafter.init_from_target
    return TargetSubset(last_layers=cfg.drafter.num_layers if copies else 0, final_norm=copies)


def pipeline_stage(topo: Topology) -> tuple[list[int], int] | None:
    """(this target group's ranks in stage order, this rank) when groups split the target into
    pipeline stages and this is a target rank, else None (`load_target(pipeline=)`)."""
    if not (topo.pipeline and topo.is_target):
        return None
    return topo.target_groups[topo.target_group_index], topo.rank


def resolve_format(cfg: RunConfig, tokenizer, log) -> RunConfig:
    """`cfg` with `data.format` resolved from the target's tokenizer (auto: chat with a chat template, text
    without), said in one line, and the eval's prompt sets checked against it; run right after the
    tokenizer loads, before the weights (the one place the format is decided)."""
    fmt, why = resolve_data_format(cfg.data.format, tokenizer, cfg.target.model)
    log(f"data: {'plain-text continuations' if fmt == 'text' else 'conversations'} (data.format={fmt}: {why})")
    if cfg.eval.num_prompts > 0:
        check_prompt_sets(cfg.eval.prompts, fmt, has_chat_template(tokenizer))
    return replace(cfg, data=replace(cfg.data, format=fmt))


def build_drafter_config(cfg: RunConfig, target) -> DrafterConfig:
    mask_id = resolve_mask_token_id(target.tokenizer, target.vocab_size, cfg.drafter.mask_token_id)
    dcfg = drafter_config_from_target(target.config, num_layers=cfg.drafter.num_layers,
                                      block_size=block_size_of(cfg.drafter), mask_token_id=mask_id,
                                      target_layer_ids=cfg.target.layer_ids, num_taps=cfg.drafter.num_taps,
                                      sliding_window=cfg.drafter.sliding_window,
                                      window_layers=cfg.drafter.window_layers, window_causal=cfg.drafter.window_causal,
                                      vocab_size=target.vocab_size, arch=cfg.drafter.arch,
                                      head_settings=head_settings(cfg.drafter))
    dcfg.check_target(target.hidden_size, target.num_layers, target.vocab_size)
    problems = target.scaling_problems(dcfg.scaling)  # the derived scaling, against the target's own forward
    if problems:
        raise ValueError(f"target {cfg.target.model} ({target.config.model_type}) cannot be drafted for as the "
                         "engines run a DFlash drafter:\n  " + "\n  ".join(problems))
    return dcfg


def init_drafter(dcfg: DrafterConfig, target, seed: int, from_target: bool, device,
                 norm_scale: float = 1.0) -> DFlashDrafter:
    """Seeded HF-style init; with `from_target`:
    - the final norm copies the target's, so the frozen lm_head sees inputs at the scale it was
      trained on (a sensible initial logit scale instead of logits ~N(0, H));
    - each drafter layer copies the matching weights of one of the target's last layers where
      shapes agree (q_norm/k_norm, absent in Llama targets, stay at one);
    - fc starts as the identity on the deepest tap and hidden_norm as the first copied layer's
      input norm, so the injected context starts as that layer's own normalised input, which its
      copied k_proj/v_proj were trained on.
    `norm_scale` then multiplies the final norm weight: the initial logit scale.
    Built on the meta device and materialised on `device` (float32): no default init on the CPU
    and no copy over (13.7 s for a Qwen3-8B-sized drafter when built on the CPU); the random
    values still come from a seeded CPU generator, so they are the same on every device."""
    with torch.device("meta"):
        drafter = build_drafter(dcfg)
    drafter = drafter.to_empty(device=device).float()
    drafter.reset_parameters(generator=torch.Generator().manual_seed(seed))  # sets every parameter
    if from_target:
        _copy_from_target(drafter, target)
    with torch.no_grad():
        drafter.norm.weight.mul_(norm_scale)
    return drafter


@dataclass(frozen=True)
class Kernels:
    """How this process runs the drafter's step, decided once from the config, the device and the drafter's width."""

    backend: str  # attention: flex | sdpa | dense
    compiled: bool
    precision: tuple[str, str]  # the drafter's matmuls, bf16 | fp8, and why (fp8.resolve_precision)
    graphs: bool = False  # train.compile_mode=reduce-overhead on CUDA: forward and backward replayed as CUDA graphs

    @property
    def compile_mode(self) -> str | None:
        """torch.compile's mode for the drafter (None: torch's default)."""
        return "reduce-overhead" if self.graphs else None

    def pad_multiple(self, max_len: int) -> int:
        """A compiled step pads every micro-batch to data.max_len whatever its samples' lengths (one static
        shape, so one graph: what the compile prewarm relies on); an eager one to a multiple of PAD_MULTIPLE."""
        return max_len if self.compiled else PAD_MULTIPLE


def resolve_kernels(cfg: RunConfig, device, dcfg: DrafterConfig) -> Kernels:
    compiled = resolve_compile(cfg.train.compile, device)
    graphs = compiled and cfg.train.compile_mode == "reduce-overhead" and torch.device(device).type == "cuda"
    return Kernels(resolve_backend(cfg.train.attention, device), compiled,
                   resolve_precision(cfg.train.precision, device, dcfg.hidden_size, compiled), graphs)


def batch_plan(cfg: RunConfig, num_drafters: int) -> BatchPlan:
    return BatchPlan(cfg.train.seqs_per_step, cfg.train.micro_batch, num_drafters)


def collate_args(cfg: RunConfig, kernels: Kernels) -> CollateArgs:
    """How samples become a micro-batch: right-padded to `Kernels.pad_multiple`, never beyond data.max_len."""
    return CollateArgs(cfg.train.seed, cfg.train.num_anchors, kernels.pad_multiple(cfg.data.max_len), cfg.data.max_len)


# The step's parts, built by the loop and by the compile prewarm (train/prewarm/worker.py) through the same
# functions, so that the prewarm compiles the very graphs the first step will look up.

def drafter_and_optimizer(cfg: RunConfig, dcfg: DrafterConfig, target, device, total_steps: int, budget=None,
                          log=None, from_target: bool | None = None):
    """(drafter, optimizer, scheduler): the seeded drafter (`init_drafter`; `from_target` defaults to
    drafter.init_from_target) and its optimizer and schedule (`build_optimizer`; `log` says Muon's split)."""
    from_target = cfg.drafter.init_from_target if from_target is None else from_target
    drafter = init_drafter(dcfg, target, cfg.train.seed, from_target, device, cfg.drafter.init_norm_scale)
    optimizer, scheduler = build_optimizer(drafter.named_parameters(), cfg.optim, total_steps, budget=budget, log=log)
    return drafter, optimizer, scheduler


def step_model(drafter, optimizer, cfg: RunConfig, kernels: Kernels, device, dp_group, num_drafters: int, log):
    """What the step calls: the drafter in the optimizer's parameter dtype, DDP-wrapped and compiled as configured."""
    return parallelize(drafter, device=device, compile_model=kernels.compiled, dp_group=dp_group,
                       num_drafters=num_drafters, param_dtype=param_dtype(optimizer), precision=kernels.precision[0],
                       compile_mode=kernels.compile_mode, fp8_recipe=cfg.train.fp8_recipe,
                       fp8_filter=cfg.train.fp8_filter, log=log)


def step_context(cfg: RunConfig, target, dcfg: DrafterConfig, drafter, vocab, kernels: Kernels, device, dp_group,
                 num_drafters: int, log) -> StepContext:
    """The step's frozen inputs: the target's embedding and lm_head (restricted to `vocab`, `train_vocab_of`, when
    given), the loss and its kernels."""
    lm_head = target.lm_head_weight.detach()
    vocab = vocab.to(device) if vocab is not None else None
    loss_head = vocab.restrict(lm_head) if vocab is not None else lm_head
    return StepContext(embed_weight=target.embed_weight.detach(), lm_head_weight=lm_head, drafter=dcfg,
                       gamma=gamma_of(cfg), chunk_tokens=cfg.loss.chunk_tokens, backend=kernels.backend,
                       device=device, autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                       dp_group=dp_group, num_drafters=num_drafters, compile_loss=kernels.compiled,
                       train_vocab=vocab, train_lm_head=loss_head if vocab is not None else None,
                       loss=LossMix.from_config(cfg.loss), loss_head_fp8=loss_head_fp8(cfg, kernels, loss_head, log),
                       head=drafter, weighting=cfg.loss.weighting, dpace_alpha=cfg.loss.dpace_alpha,
                       head_weight=cfg.loss.head_weight, persistent_masks=PersistentMasks() if kernels.graphs else None)


def loss_head_fp8(cfg: RunConfig, kernels: Kernels, loss_head: torch.Tensor, log):
    """The loss's lm_head in float8 (train.fp8_lm_head), cast once: the weight is frozen."""
    asked = cfg.train.fp8_lm_head
    if kernels.precision[0] != "fp8" or asked is False:
        if asked:
            log(f"fp8: train.fp8_lm_head=true unused: the drafter trains in {kernels.precision[0]} "
                f"({kernels.precision[1]})")
        return None
    from dflash_train.fp8 import float8_head, fp8_aligned

    if asked is None and not fp8_aligned(*loss_head.shape):
        log(f"fp8: lm_head {tuple(loss_head.shape)} stays bf16 in the loss (not a multiple of {FP8_ALIGN})")
        return None

    log(f"fp8: lm_head {tuple(loss_head.shape)} in float8 in the loss (e4m3 weight, cast once; dynamic scales)")
    return float8_head(loss_head)


def _copy_from_target(drafter: DFlashDrafter, target) -> None:
    """Norm weights are copied as the factor the target's norm applies (`norm_factor`: Gemma's
    `1 + w`), the drafter's norms being `x * w`."""
    with torch.no_grad():
        norm = norm_factor(target.final_norm)
        if norm is not None and norm.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(norm)
        source_layers = list(target.layers)[-len(drafter.layers):]
        hidden = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -hidden:].copy_(torch.eye(hidden))  # [H, K*H]: pick the last tap
        first_norm = getattr(source_layers[0], "input_layernorm", None)
        first_norm = norm_factor(first_norm) if first_norm is not None else None
        if first_norm is not None and first_norm.shape == drafter.hidden_norm.weight.shape:
            drafter.hidden_norm.weight.copy_(first_norm)
        for ours, theirs in zip(drafter.layers, source_layers):
            theirs_state = theirs.state_dict()
            for name, param in ours.state_dict().items():
                src = theirs_state.get(name)
                if src is not None and not src.is_meta and src.shape == param.shape:  # meta: not held
                    param.copy_(_copied(theirs, name, src))


def _copied(layer, name: str, src: torch.Tensor) -> torch.Tensor:
    """A target layer's tensor as the drafter's layer takes it: a norm's factor (`norm_factor`, where it
    reads as one), any other weight as it is."""
    if name.endswith("norm.weight"):
        factor = norm_factor(layer.get_submodule(name.removesuffix(".weight")))
        if factor is not None:
            return factor
    return _dense(src).float()


def _dense(weight: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a target weight: an FP8 target's (target.precision=fp8) quantized
    weights are torchao tensor subclasses, dequantized here (the copy starts from their rounding)."""
    dequantize = getattr(weight, "dequantize", None)
    return dequantize() if callable(dequantize) and type(weight) is not torch.Tensor else weight


def data_source_name(cfg: RunConfig, target) -> str:
    """The target as the data caches' keys name it: the model and the numerics its answers and taps
    come from (dtype; fp8 decoder linears), so a run with other numerics never reads another's cache."""
    name = f"{cfg.target.model}|{str(target.dtype).removeprefix('torch.')}"
    return f"{name}|fp8" if cfg.target.precision == "fp8" else name


def load_or_build_samples(cfg: RunConfig, target, topo: Topology, work_dir: Path, log, heartbeat=None,
                          group=None):
    """The main drafter rank prepares (and caches) the samples in its `work_dir` (it alone may hold
    the whole target that regenerating needs); every other rank waits, then reads its own node's
    copy: the same file where the disk is shared, else one received from the main rank
    (`share_file`)."""
    path = None
    if topo.is_main or not topo.distributed:
        path = prepare_samples(cfg.data, target, data_source_name(cfg, target), work_dir, cfg.train.seed, log,
                               heartbeat)
    if topo.distributed:
        path = share_file(path, work_dir, topo.drafter_ranks[0], group, log)
    return load_samples(path, cfg.data.eval_fraction, target.vocab_size)


SHARE_CHUNK = 64 << 20  # bytes per broadcast when a node receives a file


def share_file(path: Path | None, work_dir: Path, src: int, group, log) -> Path:
    """Rank `src`'s file `path` as a file of this rank's own `work_dir`: the same one where the
    disk is shared (same name, size and sha256), else sent by `src` over `group` and written once
    per node (`cache.build_once`). Collective over `group`."""
    meta = [(path.name, path.stat().st_size, cache.file_sha256(path)) if path is not None else None]
    dist.broadcast_object_list(meta, src=src, group=group)
    name, size, sha = meta[0]
    local = Path(work_dir) / name
    missing = not (local.is_file() and local.stat().st_size == size and cache.file_sha256(local) == sha)
    needed = torch.tensor([int(missing)])
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    if not needed.item():
        return local
    data = torch.empty(size, dtype=torch.uint8)
    if path is not None:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    for start in range(0, size, SHARE_CHUNK):
        dist.broadcast(data[start:start + SHARE_CHUNK], src=src, group=group)
    if missing:
        received = data.numpy().tobytes()
        if hashlib.sha256(received).hexdigest() != sha:
            raise RuntimeError(f"{name} from rank {src}: the received bytes do not match its sha256")
        if local.exists():  # another version of it (a build that is not deterministic): replaced, atomically
            atomic.write_bytes(local, received)
        cache.build_once(local, lambda tmp: tmp.write_bytes(received), f"{name} received from rank {src}",
                         directory=False, log=log)
        log(f"data: {local} received from rank {src} ({size / 1e6:.1f} MB): this node's disk did not have it")
    return local


def taps_from_regeneration(cfg: RunConfig, topo: Topology) -> bool:
    """Regenerate + tap in one pass: single-process colocated runs that regenerate their data."""
    return cfg.data.regenerate and cfg.data.tap_during_regeneration and topo.target_in_process \
        and not topo.distributed


def prepare_tapped(cfg: RunConfig, target, layer_ids, spec: TapsSpec, work_dir: Path, log, heartbeat=None) -> Data:
    """Regenerate + tap (cached), the rows packed end to end where `data.taps_device` puts them."""
    tapped, ((train, train_index), (held_out, held_out_index)) = prepare_tapped_samples(
        cfg.data, target, data_source_name(cfg, target), layer_ids, work_dir, cfg.train.seed, log, heartbeat,
        final_hidden=FINAL_HIDDEN in spec.names)
    packed = PackedRows.of_lengths(pick_entries(tapped.packed(), spec.names), [len(s) for s in tapped.samples])
    rows = packed.subset(train_index), packed.subset(held_out_index)
    return Data(train, held_out, place(rows, cfg.data.taps_device, target.device, log))


def samples_from_shards(cfg: RunConfig, layer_ids: list[int], spec: TapsSpec, log) -> Data:
    """Offline mode: samples from `dflash-train prepare` shards, split by id hash; taps stay on disk."""
    reader = ShardReader(cfg.data.shards, seed=cfg.train.seed, dtype=torch.float32)
    missing = [name for name in spec.names if name not in reader.entries]
    if missing:
        raise ValueError(f"data.shards {cfg.data.shards} lack {missing}: loss.kind={cfg.loss.kind} needs the "
                         "target's final hidden state; re-run `dflash-train prepare` with this loss.kind "
                         "into a new --out directory")
    if reader.layer_ids != list(layer_ids):
        raise ValueError(f"data.shards {cfg.data.shards}: tapped layers {reader.layer_ids} differ from the "
                         f"drafter's target_layer_ids {list(layer_ids)}; set target.layer_ids to match")
    samples = []
    for i in range(len(reader)):
        row = reader.tokens(i)  # ids and masks only: the taps stay on disk until a step reads them
        samples.append(Sample(row["id"], tuple(row["input_ids"].tolist()), tuple(row["loss_mask"].tolist())))
    (train, train_rows), (held_out, held_out_rows) = split_held_out(samples, cfg.data.eval_fraction)
    log(f"data: {len(train)} train / {len(held_out)} held-out samples from shards {cfg.data.shards}")
    return Data(train, held_out, (StoredRows.from_shards(reader, spec.names, train_rows),
                                  StoredRows.from_shards(reader, spec.names, held_out_rows)))


def eval_batches(samples: list[Sample], num_anchors: int, pad_multiple: int, max_len: int,
                 max_samples: int = 32, per_batch: int = 1) -> list[MicroBatch]:
    """Held-out micro-batches of `per_batch` samples each (right-padded to the longest of them), with
    deterministic anchors (simulated tau)."""
    chosen = samples[:max_samples]
    return [_eval_batch(chosen[i:i + per_batch], num_anchors, pad_multiple, max_len)
            for i in range(0, len(chosen), per_batch)]


def _eval_batch(group: list[Sample], num_anchors: int, pad_multiple: int, max_len: int) -> MicroBatch:
    seq_len = padded_length([len(s) for s in group], pad_multiple, max_len)
    ids, mask, attn = (torch.zeros(len(group), seq_len, dtype=torch.long) for _ in range(3))  # [b, S] each
    anchors = torch.zeros(len(group), num_anchors, dtype=torch.long)  # [b, N]
    keep = torch.zeros(len(group), num_anchors, dtype=torch.bool)
    for row, s in enumerate(group):
        n = min(len(s), seq_len)
        ids[row, :n], mask[row, :n], attn[row, :n] = torch.tensor(s.input_ids[:n]), torch.tensor(s.loss_mask[:n]), 1
        anchors[row], keep[row] = all_anchors(mask[row], num_anchors)
    return MicroBatch([s.id for s in group], ids, mask, attn, anchors, keep)


def train_vocab_of(cfg: RunConfig, samples: list[Sample], vocab_size: int, log):
    """The training softmax subset of `loss.train_vocab` (every token of the training samples plus
    the lowest ids), or None for the full vocabulary."""
    if cfg.loss.train_vocab is None:
        return None
    vocab = vocab_subset((s.input_ids for s in samples), vocab_size, cfg.loss.train_vocab, multiple=FP8_ALIGN)
    log(f"loss: training softmax over {vocab.ids.numel()} of {vocab_size} tokens (loss.train_vocab); "
        "held-out simulated tau uses all of them; the export carries them as the draft vocabulary")
    return vocab


def gamma_of(cfg: RunConfig) -> float:
    return derived_gamma(block_size_of(cfg.drafter), cfg.loss.gamma)


def total_steps_of(cfg: RunConfig, steps_per_epoch: int) -> int:
    by_epochs = cfg.train.epochs * steps_per_epoch
    return min(by_epochs, cfg.train.max_steps) if cfg.train.max_steps else by_epochs


def describe_coverage(c: dict, num_anchors: int) -> str:
    """One line of `anchors.anchor_coverage` (published pitfall 2: no document starved of anchors)."""
    return (f"anchors     per supervised token and document: median {c['median']:.2f}, min {c['min']:.2f} over "
            f"{c['documents']} documents; {c['capped']} capped at {num_anchors}, {c['starved']} starved "
            "(every eligible position of the others is an anchor)")


def describe(cfg: RunConfig, dcfg: DrafterConfig, topo: Topology, n_train: int, n_eval: int, total: int,
             accum: int, kernels: Kernels, taps_bytes_per_token: int, coverage: dict | None = None) -> str:
    precision = kernels.precision
    lines = [
        f"topology    {topo.describe()}",
        f"target      {cfg.target.model}: taps after layers {list(dcfg.target_layer_ids)} of {dcfg.num_target_layers}"
        f" (z-lab ids; vLLM aux ids {[i + 1 for i in dcfg.target_layer_ids]}), {taps_bytes_per_token} bytes/token",
        f"drafter     {dcfg.num_layers} layers x {dcfg.hidden_size}, heads {dcfg.num_heads}/{dcfg.num_kv_heads}, "
        f"block {dcfg.block_size}, mask token {dcfg.mask_token_id}, layer types {sorted(set(dcfg.layer_types))}",
        f"data        {n_train} train / {n_eval} held-out samples, max_len {cfg.data.max_len}",
        f"batch       {cfg.train.seqs_per_step} seqs/step = {cfg.train.micro_batch} per micro-batch x {accum} accum x "
        f"{topo.num_drafters} drafter rank(s); {cfg.train.num_anchors} anchors/seq (<= eligible positions)",
        *([describe_coverage(coverage, cfg.train.num_anchors)] if coverage else []),
        f"schedule    {total} steps, lr {cfg.optim.lr} cosine, warm-up {cfg.optim.warmup_ratio:.0%}, clip "
        f"{cfg.optim.grad_clip}, gamma {gamma_of(cfg)}",
        f"kernels     attention={kernels.backend}, compile={'on' if kernels.compiled else 'off'}"
        f"{' (CUDA graphs: reduce-overhead)' if kernels.graphs else ''}, precision drafter "
        f"{precision[0]}{f' {cfg.train.fp8_recipe}' if precision[0] == 'fp8' else ''} ({precision[1]}), "
        f"target {cfg.target.precision}",
    ]
    return "\n".join(lines)
