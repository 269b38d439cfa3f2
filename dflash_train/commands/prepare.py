"""`dflash-train prepare --data D --out DIR [--format bf16|fp8] [...]`: offline hidden-state shards
(data/shards.py) that `topology.mode=offline data.shards=DIR` trains from; a killed prepare
resumes after its last complete shard.

Under torchrun the processes form target groups of `topology.target_group_size` consecutive ranks
(a target too large for one device, sharded over its group as in training): each group prepares a
contiguous share of the samples into `DIR/group-NNNNN/` (its own index, resumable), every member
runs the forwards and only the group's first rank writes; rank 0 then writes `DIR/index.json`
over all groups' shards.
"""

from __future__ import annotations

from dflash_train.commands import Alias
from dflash_train.commands.groups import Groups, join_groups
from dflash_train.validate import validate_prepare as validate  # noqa: F401 - the command's check

HELP = "write offline hidden-state shards"
RECIPE = None
READS = ("target", "data.train", "data.shards", "data.shard_format", "data.shard_mb", "data.prepare_batch_tokens",
         "data.max_len", "data.min_loss_tokens", "data.thinking", "data.skip_bad_rows", "data.max_samples",
         "drafter.num_taps", "train.seed", "topology.device", "topology.target_group_size", "loss.kind")
ALIASES = (
    Alias("--target", "target.model"), Alias("--data", "data.train"), Alias("--out", "data.shards"),
    Alias("--format", "data.shard_format"), Alias("--layer-ids", "target.layer_ids"),
    Alias("--num-taps", "drafter.num_taps"), Alias("--max-len", "data.max_len"),
    Alias("--min-loss-tokens", "data.min_loss_tokens"), Alias("--thinking", "data.thinking"),
    Alias("--skip-bad-rows", "data.skip_bad_rows", const="true"), Alias("--max-samples", "data.max_samples"),
    Alias("--seed", "train.seed"), Alias("--shard-mb", "data.shard_mb"),
    Alias("--batch-tokens", "data.prepare_batch_tokens"), Alias("--device", "topology.device"),
    Alias("--dtype", "target.dtype"),
)


def run(cfg) -> str:
    from dflash_train.data.conversations import read_conversations, tokenize_conversations
    from dflash_train.data.text import check_data_format
    from dflash_train.model.drafter.config import tap_layer_ids
    from dflash_train.model.target.load import load_target

    d = cfg.data
    groups = join_groups(cfg)
    conversations, bad = read_conversations(d.train, d.skip_bad_rows, d.max_samples, cfg.train.seed)
    # conversations go through the chat template: a base model without one fails before its weights load
    target = load_target(cfg.target.model, cfg.target.gguf_file, cfg.target.dtype, groups.device,
                         cfg.target.trust_remote_code, tp_mesh=groups.mesh,
                         check_tokenizer=lambda tok: check_data_format("chat", tok, cfg.target.model))
    samples, bad = tokenize_conversations(target.tokenizer, conversations, d.max_len, d.min_loss_tokens,
                                          d.thinking, bad)
    print(f"prepare: {len(samples)} samples from {len(conversations)} conversations; {bad.summary()}", flush=True)
    if not samples:
        raise ValueError(f"no sample has {d.min_loss_tokens}+ supervised tokens ({bad.summary()}); "
                         "prompt-only data (such as 'default') needs `dflash-train regenerate` first")
    layer_ids = tap_layer_ids(target.num_layers, cfg.drafter.num_taps, cfg.target.layer_ids)  # as training does
    if groups.world > 1:
        return _prepare_in_groups(cfg, target, samples, layer_ids, groups)
    return _describe(_write(cfg, target, samples, d.shards, layer_ids), d.shards)


def _describe(r, where) -> str:
    return (f"{r.samples} samples, {r.tokens} tokens in {r.shards} shards ({r.bytes / 2**20:.1f} MiB) at "
            f"{where}; {r.resumed_after} were already done")


def _write(cfg, target, samples, out_dir, layer_ids):
    from dflash_train.data.shards import bytes_per_token, prepare_shards

    d = cfg.data
    tap_width = len(layer_ids) * target.hidden_size
    final_hidden = cfg.loss.needs_target_hidden  # a distillation loss reads the target's final hidden state
    final_width = target.hidden_size if final_hidden else 0
    shard_tokens = max(1, int(d.shard_mb * 2**20) // bytes_per_token(tap_width, d.shard_format, final_width))
    return prepare_shards(target, samples, out_dir, layer_ids, d.shard_format, shard_tokens, d.prepare_batch_tokens,
                          target_name=cfg.target.model, final_hidden=final_hidden)


def _prepare_in_groups(cfg, target, samples, layer_ids, groups: Groups):
    """This group's share, written by its first rank (the others run the same forwards); after all
    groups are done, rank 0 writes the index over every group's shards."""
    import torch.distributed as dist  # see commands/__init__.py

    from dflash_train.data.shards import follow_prepare, group_dir, group_share, merge_group_indexes

    share, out_dir = group_share(samples, groups.group, groups.count), group_dir(cfg.data.shards, groups.group)
    print(f"prepare: rank {groups.rank}, target group {groups.group} of {groups.count}: samples "
          f"{len(share)} of {len(samples)} -> {out_dir}{'' if groups.writes else ' (computes, its first rank writes)'}",
          flush=True)
    detail = f"rank {groups.rank} of target group {groups.group}: computed taps, its first rank wrote them"
    if groups.writes:
        detail = _describe(_write(cfg, target, share, out_dir, layer_ids), out_dir)
    else:
        follow_prepare(target, share, out_dir, layer_ids, cfg.data.prepare_batch_tokens, cfg.loss.needs_target_hidden)
    dist.barrier()  # every group's index is complete before rank 0 merges them
    if groups.rank == 0:
        merged = merge_group_indexes(cfg.data.shards, samples, groups.count)
        detail = f"{_describe(merged, cfg.data.shards)} (this rank's group: {detail})"
    dist.barrier()
    dist.destroy_process_group()
    return detail
