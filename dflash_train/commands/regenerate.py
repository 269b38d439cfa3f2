"""`dflash-train regenerate --out FILE [--target T] [--data D] [...]`: the target writes the
assistant replies (data/regenerate.py); an interrupted run resumes with no duplicate and no gap."""

from __future__ import annotations

from dflash_train.commands import Alias, load_configured_target
from dflash_train.validate import validate_regenerate as validate  # noqa: F401 - the command's check

HELP = "regenerate assistant responses with the target"
RECIPE = None
READS = ("target", "data.train", "data.regen_out", "data.regen_max_new_tokens", "data.regen_batch_size",
         "data.regen_temperature", "data.thinking", "data.skip_bad_rows", "data.max_samples", "train.seed",
         "topology.device")
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

    d = cfg.data
    conversations, bad = read_conversations(d.train, d.skip_bad_rows, d.max_samples, cfg.train.seed)
    print(f"regenerate: {len(conversations)} conversations from {d.train}; {bad.summary()}", flush=True)
    # conversations go through the chat template: a base model without one fails before its weights load
    target = load_configured_target(cfg, check_tokenizer=lambda tok: check_data_format("chat", tok,
                                                                                        cfg.target.model))
    r = regenerate(target, conversations, d.regen_out, d.regen_max_new_tokens, d.regen_batch_size,
                   d.regen_temperature, d.thinking, cfg.train.seed)
    rate = r.new_tokens / r.seconds if r.seconds else 0.0
    return (f"{r.written} new + {r.already_done} already done = {r.total} rows in {d.regen_out}; {r.new_tokens} "
            f"tokens at {rate:.0f} tok/s, {r.truncated} hit max-new-tokens; {bad.total} bad rows skipped")
