"""`dflash-train prepare --data D --out DIR [--format bf16|fp8] [...]`: offline hidden-state shards
(data/shards.py) that `topology.mode=offline data.shards=DIR` trains from; a killed prepare
resumes after its last complete shard."""

from __future__ import annotations

from dflash_train.commands import Alias, load_configured_target
from dflash_train.validate import validate_prepare as validate  # noqa: F401 - the command's check

HELP = "write offline hidden-state shards"
RECIPE = None
READS = ("target", "data.train", "data.shards", "data.shard_format", "data.shard_mb", "data.prepare_batch_tokens",
         "data.max_len", "data.min_loss_tokens", "data.thinking", "data.skip_bad_rows", "data.max_samples",
         "drafter.num_taps", "train.seed", "topology.device", "loss.kind")
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
    from dflash_train.data.shards import bytes_per_token, prepare_shards
    from dflash_train.data.text import check_data_format
    from dflash_train.model.config import tap_layer_ids

    d = cfg.data
    conversations, bad = read_conversations(d.train, d.skip_bad_rows, d.max_samples, cfg.train.seed)
    # conversations go through the chat template: a base model without one fails before its weights load
    target = load_configured_target(cfg, check_tokenizer=lambda tok: check_data_format("chat", tok,
                                                                                        cfg.target.model))
    samples, bad = tokenize_conversations(target.tokenizer, conversations, d.max_len, d.min_loss_tokens,
                                          d.thinking, bad)
    print(f"prepare: {len(samples)} samples from {len(conversations)} conversations; {bad.summary()}", flush=True)
    if not samples:
        raise ValueError(f"no sample has {d.min_loss_tokens}+ supervised tokens ({bad.summary()}); "
                         "prompt-only data (such as 'default') needs `dflash-train regenerate` first")
    layer_ids = tap_layer_ids(target.num_layers, cfg.drafter.num_taps, cfg.target.layer_ids)  # as training does
    tap_width = len(layer_ids) * target.hidden_size
    final_hidden = cfg.loss.needs_target_hidden  # a distillation loss reads the target's final hidden state
    final_width = target.hidden_size if final_hidden else 0
    shard_tokens = max(1, int(d.shard_mb * 2**20) // bytes_per_token(tap_width, d.shard_format, final_width))
    r = prepare_shards(target, samples, d.shards, layer_ids, d.shard_format, shard_tokens, d.prepare_batch_tokens,
                       target_name=cfg.target.model, final_hidden=final_hidden)
    return (f"{r.samples} samples, {r.tokens} tokens in {r.shards} shards ({r.bytes / 2**20:.1f} MiB) at "
            f"{d.shards}; {r.resumed_after} were already done")
