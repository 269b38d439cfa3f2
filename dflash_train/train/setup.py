"""The pieces `train()` assembles: target, drafter, samples, held-out batches, resume.

Kept apart from the loop so `loop.py` reads top to bottom; every function here is plain setup
with no hidden state.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train.config import RunConfig, derived_gamma
from dflash_train.data.anchors import all_anchors
from dflash_train.model.config import DrafterConfig, drafter_config_from_target
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.train.batching import MicroBatch, Sample, padded_length
from dflash_train.train.topology import Topology


def build_drafter_config(cfg: RunConfig, target) -> DrafterConfig:
    from dflash_train.model.target import resolve_mask_token_id

    mask_id = resolve_mask_token_id(target.tokenizer, target.vocab_size, cfg.drafter.mask_token_id)
    dcfg = drafter_config_from_target(target.config, num_layers=cfg.drafter.num_layers,
                                      block_size=cfg.drafter.block_size, mask_token_id=mask_id,
                                      target_layer_ids=cfg.target.layer_ids, num_taps=cfg.drafter.num_taps,
                                      sliding_window=cfg.drafter.sliding_window, vocab_size=target.vocab_size)
    dcfg.check_target(target.hidden_size, target.num_layers, target.vocab_size)
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
    `norm_scale` then multiplies the final norm weight: the initial logit scale."""
    drafter = DFlashDrafter(dcfg)
    drafter.reset_parameters(generator=torch.Generator().manual_seed(seed))
    if from_target:
        _copy_from_target(drafter, target)
    with torch.no_grad():
        drafter.norm.weight.mul_(norm_scale)
    return drafter.to(device=device, dtype=torch.float32)


def _copy_from_target(drafter: DFlashDrafter, target) -> None:
    with torch.no_grad():
        norm = getattr(target.final_norm, "weight", None)
        if norm is not None and norm.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(norm.float())
        source_layers = list(target.layers)[-len(drafter.layers):]
        hidden = drafter.config.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -hidden:].copy_(torch.eye(hidden))  # [H, K*H]: pick the last tap
        first_norm = getattr(getattr(source_layers[0], "input_layernorm", None), "weight", None)
        if first_norm is not None and first_norm.shape == drafter.hidden_norm.weight.shape:
            drafter.hidden_norm.weight.copy_(first_norm.float())
        for ours, theirs in zip(drafter.layers, source_layers):
            theirs_state = theirs.state_dict()
            for name, param in ours.state_dict().items():
                src = theirs_state.get(name)
                if src is not None and src.shape == param.shape:
                    param.copy_(src.float())


def load_or_build_samples(cfg: RunConfig, target, topo: Topology, work_dir: Path, log, heartbeat=None):
    """The main drafter rank prepares (and caches) the samples; every other rank waits, then reads."""
    from dflash_train.data.dataset import load_samples, prepare_samples

    path = None
    if topo.is_main or not topo.distributed:
        path = prepare_samples(cfg.data, target, cfg.target.model, work_dir, cfg.train.seed, log, heartbeat)
    if topo.distributed:
        holder = [str(path) if path else None]
        dist.broadcast_object_list(holder, src=topo.drafter_ranks[0])
        path = Path(holder[0])
    return load_samples(path, cfg.data.eval_fraction)


def taps_from_regeneration(cfg: RunConfig, topo: Topology) -> bool:
    """Regenerate + tap in one pass: single-process colocated runs that regenerate their data."""
    return cfg.data.regenerate and cfg.data.tap_during_regeneration and topo.mode == "colocated" \
        and not topo.distributed


def prepare_tapped(cfg: RunConfig, target, layer_ids, work_dir: Path, log, heartbeat=None):
    from dflash_train.data.dataset import prepare_tapped as prepare

    return prepare(cfg.data, target, cfg.target.model, layer_ids, work_dir, cfg.train.seed, log, heartbeat)


class ShardTaps:
    """Taps of selected shard rows, read from disk when a step needs them (shards can be TBs)."""

    def __init__(self, reader, rows: list[int]):
        self.reader, self.rows = reader, rows

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.reader.sample(self.rows[i])["taps"]

    def __iter__(self):
        return (self[i] for i in range(len(self.rows)))


def samples_from_shards(cfg: RunConfig, layer_ids: list[int], log):
    """Offline mode: samples from `dflash-train prepare` shards, split by id hash; taps stay on disk."""
    from dflash_train.data.dataset import _is_heldout
    from dflash_train.data.shards import ShardReader

    reader = ShardReader(cfg.data.shards, seed=cfg.train.seed, dtype=torch.float32)
    if reader.layer_ids != list(layer_ids):
        raise ValueError(f"data.shards {cfg.data.shards}: tapped layers {reader.layer_ids} differ from the "
                         f"drafter's target_layer_ids {list(layer_ids)}; set target.layer_ids to match")
    split = {"train": ([], []), "held_out": ([], [])}
    for i in range(len(reader)):
        row = reader.tokens(i)  # ids and masks only: the taps stay on disk until a step reads them
        sample = Sample(row["id"], tuple(row["input_ids"].tolist()), tuple(row["loss_mask"].tolist()))
        part = split["held_out" if _is_heldout(sample.id, cfg.data.eval_fraction) else "train"]
        part[0].append(sample)
        part[1].append(i)
    log(f"data: {len(split['train'][0])} train / {len(split['held_out'][0])} held-out samples from shards "
        f"{cfg.data.shards}")
    return ((split["train"][0], ShardTaps(reader, split["train"][1])),
            (split["held_out"][0], ShardTaps(reader, split["held_out"][1])))


def fill_eval_taps(eval_mbs: list[MicroBatch], taps: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Held-out micro-batches (one sample each, in order) get their stored taps, zero-padded."""
    for mb, row in zip(eval_mbs, taps):
        mb.taps = torch.zeros(*mb.input_ids.shape, row.shape[-1], dtype=dtype)
        n = min(row.shape[0], mb.input_ids.shape[1])
        mb.taps[0, :n] = row[:n].to(dtype)


def eval_batches(samples: list[Sample], num_anchors: int, pad_multiple: int, max_len: int,
                 max_samples: int = 32) -> list[MicroBatch]:
    """Held-out micro-batches of one sample each, with deterministic anchors (simulated tau)."""
    out = []
    for s in samples[:max_samples]:
        seq_len = padded_length([len(s)], pad_multiple, max_len)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        mask = torch.zeros(1, seq_len, dtype=torch.long)
        attn = torch.zeros(1, seq_len, dtype=torch.long)
        n = min(len(s), seq_len)
        ids[0, :n], mask[0, :n], attn[0, :n] = torch.tensor(s.input_ids[:n]), torch.tensor(s.loss_mask[:n]), 1
        anchors, keep = all_anchors(mask[0], num_anchors)
        out.append(MicroBatch([s.id], ids, mask, attn, anchors[None], keep[None]))
    return out


def train_vocab_of(cfg: RunConfig, samples: list[Sample], vocab_size: int, log):
    """The training softmax subset of `loss.train_vocab` (every token of the training samples plus
    the lowest ids), or None for the full vocabulary."""
    if cfg.loss.train_vocab is None:
        return None
    from dflash_train.train.vocab import vocab_subset

    vocab = vocab_subset((s.input_ids for s in samples), vocab_size, cfg.loss.train_vocab)
    log(f"loss: training softmax over {vocab.ids.numel()} of {vocab_size} tokens (loss.train_vocab); "
        "held-out and real eval use all of them")
    return vocab


def gamma_of(cfg: RunConfig) -> float:
    return derived_gamma(cfg.drafter.block_size, cfg.loss.gamma)


def total_steps_of(cfg: RunConfig, steps_per_epoch: int) -> int:
    by_epochs = cfg.train.epochs * steps_per_epoch
    return min(by_epochs, cfg.train.max_steps) if cfg.train.max_steps else by_epochs


def validate_run(cfg: RunConfig, topo: Topology) -> None:
    if cfg.loss.kind != "ce":
        raise ValueError(f"loss.kind={cfg.loss.kind!r}: the training pipeline supports 'ce' so far; the teacher "
                         "losses exist in train/loss.py (block_loss with teacher_hidden / teacher argmax labels)")
    if topo.mode == "disaggregated" and cfg.train.max_minutes:
        raise ValueError("train.max_minutes needs mode=colocated: target ranks must know the step count in "
                         "advance; set train.max_steps instead")
    if topo.mode == "offline" and not cfg.data.shards:
        raise ValueError("topology.mode=offline needs data.shards=DIR (written by `dflash-train prepare`)")
    if topo.mode != "offline":
        from dflash_train.data.dataset import parse_train_spec

        parse_train_spec(cfg.data.train, cfg.data.max_samples)  # a bad data.train fails before the target loads


def describe(cfg: RunConfig, dcfg: DrafterConfig, topo: Topology, n_train: int, n_eval: int, total: int,
             accum: int, backend: str, compiled: bool, taps_bytes_per_token: int) -> str:
    lines = [
        f"topology    {topo.describe()}",
        f"target      {cfg.target.model}: taps after layers {list(dcfg.target_layer_ids)} of {dcfg.num_target_layers}"
        f" (z-lab ids; vLLM aux ids {[i + 1 for i in dcfg.target_layer_ids]}), {taps_bytes_per_token} bytes/token",
        f"drafter     {dcfg.num_layers} layers x {dcfg.hidden_size}, heads {dcfg.num_heads}/{dcfg.num_kv_heads}, "
        f"block {dcfg.block_size}, mask token {dcfg.mask_token_id}, layer types {sorted(set(dcfg.layer_types))}",
        f"data        {n_train} train / {n_eval} held-out samples, max_len {cfg.data.max_len}",
        f"batch       {cfg.train.seqs_per_step} seqs/step = {cfg.train.micro_batch} per micro-batch x {accum} accum x "
        f"{topo.num_drafters} drafter rank(s); {cfg.train.num_anchors} anchors/seq (<= eligible positions)",
        f"schedule    {total} steps, lr {cfg.optim.lr} cosine, warm-up {cfg.optim.warmup_ratio:.0%}, clip "
        f"{cfg.optim.grad_clip}, gamma {gamma_of(cfg)}",
        f"kernels     attention={backend}, compile={'on' if compiled else 'off'}",
    ]
    return "\n".join(lines)
