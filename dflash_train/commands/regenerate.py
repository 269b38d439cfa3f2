"""`dflash-train regenerate --out FILE [--target T] [--data D] [...]`: the target writes the
assistant replies (data/regenerate.py); an interrupted run resumes with no duplicate and no gap.

Under torchrun the processes form target groups of `topology.target_group_size` consecutive ranks
(commands/groups.py, as `prepare`): each group answers a contiguous share of the conversations
into `FILE`'s part `<stem>.group-NNNNN.jsonl` (appended and resumable like FILE; its other ranks run
the same sharded generation and write nothing), and rank 0 then merges the parts into FILE.
"""

from __future__ import annotations

from pathlib import Path

from dflash_train.commands import Alias
from dflash_train.commands.groups import Groups, join_groups
from dflash_train.validate import validate_regenerate as validate  # noqa: F401 - the command's check

HELP = "regenerate assistant responses with the target"
RECIPE = None
READS = ("target", "data.train", "data.regen_out", "data.regen_max_new_tokens", "data.regen_batch_size",
         "data.regen_temperature", "data.thinking", "data.skip_bad_rows", "data.max_samples", "train.seed",
         "topology.device", "topology.target_group_size")
ALIASES = (
    Alias("--target", "target.model"), Alias("--data", "data.train"), Alias("--out", "data.regen_out"),
    Alias("--max-new-tokens", "data.regen_max_new_tokens"), Alias("--batch-size", "data.regen_batch_size"),
    Alias("--temperature", "data.regen_temperature"), Alias("--thinking", "data.thinking"),
    Alias("--skip-bad-rows", "data.skip_bad_rows", const="true"), Alias("--max-samples", "data.max_samples"),
    Alias("--seed", "train.seed"), Alias("--device", "topology.device"), Alias("--dtype", "target.dtype"),
)


def run(cfg) -> str:
    from dflash_train.data.conversations import read_conversations
    from dflash_train.data.regenerate import regenerate
    from dflash_train.data.text import check_data_format
    from dflash_train.model.target.load import load_target

    d = cfg.data
    groups = join_groups(cfg)
    conversations, bad = read_conversations(d.train, d.skip_bad_rows, d.max_samples, cfg.train.seed)
    print(f"regenerate: {len(conversations)} conversations from {d.train}; {bad.summary()}", flush=True)
    # conversations go through the chat template: a base model without one fails before its weights load
    target = load_target(cfg.target.model, cfg.target.gguf_file, cfg.target.dtype, groups.device,
                         cfg.target.trust_remote_code, tp_mesh=groups.mesh,
                         check_tokenizer=lambda tok: check_data_format("chat", tok, cfg.target.model))
    if groups.world > 1:
        return _regenerate_in_groups(cfg, target, conversations, groups) + f"; {bad.total} bad rows skipped"
    r = regenerate(target, conversations, d.regen_out, d.regen_max_new_tokens, d.regen_batch_size,
                   d.regen_temperature, d.thinking, cfg.train.seed)
    return _describe(r, d.regen_out) + f"; {bad.total} bad rows skipped"


def _describe(r, where) -> str:
    rate = r.new_tokens / r.seconds if r.seconds else 0.0
    return (f"{r.written} new + {r.already_done} already done = {r.total} rows in {where}; {r.new_tokens} "
            f"tokens at {rate:.0f} tok/s, {r.truncated} hit max-new-tokens")


def _regenerate_in_groups(cfg, target, conversations, groups: Groups) -> str:
    """This group's share into its part (first rank writes, the others compute alongside); then
    rank 0 merges every part into data.regen_out."""
    import torch.distributed as dist  # see commands/__init__.py

    from dflash_train.data.regenerate import group_part, merge_parts, read_done_ids, regenerate
    from dflash_train.data.shards import group_share

    d = cfg.data
    share, part = group_share(conversations, groups.group, groups.count), group_part(d.regen_out, groups.group)
    print(f"regenerate: rank {groups.rank}, target group {groups.group} of {groups.count}: conversations "
          f"{len(share)} of {len(conversations)} -> {part}{'' if groups.writes else ' (computes, its first rank writes)'}",
          flush=True)
    # a read truncates a torn last line (a killed writer's): the writers read first, the others after
    if groups.rank == 0:
        read_done_ids(Path(d.regen_out))
    if groups.writes:
        read_done_ids(part)
    dist.barrier()
    done = read_done_ids(Path(d.regen_out)) | read_done_ids(part)  # every rank of a group: the same todo
    dist.barrier()
    r = regenerate(target, share, part, d.regen_max_new_tokens, d.regen_batch_size, d.regen_temperature,
                   d.thinking, cfg.train.seed, done=done, write=groups.writes)
    detail = f"rank {groups.rank} of target group {groups.group}: {_describe(r, part)}"
    dist.barrier()  # every part is complete before rank 0 merges them
    if groups.rank == 0:
        added = merge_parts(d.regen_out, [group_part(d.regen_out, g) for g in range(groups.count)])
        detail = f"{added} rows merged from {groups.count} group parts into {d.regen_out} ({detail})"
    dist.barrier()
    dist.destroy_process_group()
    return detail
