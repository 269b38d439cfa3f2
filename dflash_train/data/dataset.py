"""From `data.train` to tokenized training and held-out samples, cached on disk.

Order: read conversations (bad rows: error with location, or counted with --skip-bad-rows);
optionally regenerate the assistant turns with the target (append-only, resumable cache); tokenize
with the target's chat template and an assistant-only loss mask; split off a held-out fraction by
a hash of the id (stable whatever the sample count). The tokenized result is cached as JSONL keyed
by everything it depends on, built once (dflash_train.cache: a file lock, an atomic rename) by the main
process; other ranks wait and read it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dflash_train import cache
from dflash_train.config import DataConfig
from dflash_train.train.batching import Sample


def _is_heldout(sample_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=4).digest(), "little")
    return h / 2**32 < fraction


def cache_key(cfg: DataConfig, target_name: str, seed: int) -> str:
    parts = json.dumps([cfg.train, cfg.max_len, cfg.min_loss_tokens, cfg.thinking, cfg.max_samples, cfg.regenerate,
                        cfg.regen_max_new_tokens, target_name, seed, 2]
                       + ([cfg.format, cfg.text_prompt_tokens] if cfg.format != "chat" else []), sort_keys=True)
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def prepare_samples(cfg: DataConfig, target, target_name: str, work_dir: Path, seed: int, log=print,
                    heartbeat=None) -> Path:
    """Build the tokenized sample cache once (a concurrent job waits on its lock) and return its path."""
    path = work_dir / f"samples-{cache_key(cfg, target_name, seed)}.jsonl"
    def build(tmp: Path) -> None:
        _tokenize_into(tmp, cfg, target, target_name, work_dir, seed, log, heartbeat)

    if not cache.build_once(path, build, f"tokenized samples {path.name}", directory=False, log=log):
        log(f"data: using cached samples {path}")
    return path


def _tokenize_into(out: Path, cfg: DataConfig, target, target_name: str, work_dir: Path, seed: int, log,
                   heartbeat) -> None:
    from dflash_train.data.conversations import read_conversations, tokenize_conversations

    if cfg.format == "text":  # base models: plain-text continuations (data/text.py)
        from dflash_train.data.text import continuation_samples

        return _write_samples(out, continuation_samples(cfg, target, seed, log, heartbeat), cfg)
    conversations, bad = read_conversations(cfg.train, skip_bad_rows=cfg.skip_bad_rows,
                                            max_samples=cfg.max_samples, seed=seed)
    log(f"data: {len(conversations)} conversations from {cfg.train}; {bad.summary()}")
    if cfg.regenerate:
        conversations = regenerate_cached(cfg, target, target_name, conversations, work_dir, seed, log, heartbeat)
    samples, bad = tokenize_conversations(target.tokenizer, conversations, cfg.max_len, cfg.min_loss_tokens,
                                          cfg.thinking, bad)
    log(f"data: {len(samples)} tokenized samples; {bad.summary()}")
    _write_samples(out, samples, cfg, bad.summary())


def _write_samples(out: Path, samples, cfg: DataConfig, why: str = "see the log above") -> None:
    if not samples:
        raise ValueError(f"data {cfg.train!r}: no usable samples ({why})")
    out.write_text("".join(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask})
                           + "\n" for s in samples))


def regenerate_cached(cfg: DataConfig, target, target_name: str, conversations, work_dir: Path, seed: int, log,
                      heartbeat=None):
    """Responses by the target (greedy), cached in an append-only file that resumes."""
    from dflash_train.data.conversations import Conversation
    from dflash_train.data.regenerate import regenerate

    key = hashlib.sha256(json.dumps([cfg.train, target_name, cfg.regen_max_new_tokens, cfg.thinking,
                                     cfg.max_samples, seed]).encode()).hexdigest()[:16]
    out = work_dir / f"regenerated-{key}.jsonl"
    with cache.exclusive(cache.lock_path_of(out), f"regenerated responses {out.name}", log=log):  # appends resume
        report = regenerate(target, conversations, out, max_new_tokens=cfg.regen_max_new_tokens,
                            batch_size=cfg.regen_batch_size, thinking=cfg.thinking, seed=seed,
                            on_batch=(lambda b: heartbeat(f"regenerate batch {b}")) if heartbeat else None)
    log(f"data: regenerated responses in {out} ({report})")
    wanted = {c.id for c in conversations}
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [Conversation(r["id"], r["messages"]) for r in rows if r["id"] in wanted]


def prepare_tapped(cfg: DataConfig, target, target_name: str, layer_ids: list[int], work_dir: Path, seed: int,
                   log=print, heartbeat=None):
    """Regenerate + tap in one pass (cached; a concurrent job waits on its lock): (train samples, held-out
    samples, their taps)."""
    from dflash_train.data.regen_taps import TappedSamples

    path = work_dir / f"tapped-{cache_key(cfg, target_name, seed)}-{'_'.join(map(str, layer_ids))}.safetensors"

    def build(tmp: Path) -> None:
        _regenerate_and_tap(cfg, target, layer_ids, seed, log, heartbeat).save(tmp)

    if not cache.build_once(path, build, f"regenerated samples and taps {path.name}", directory=False, log=log):
        log(f"data: using cached regenerated samples and taps {path}")
    tapped = TappedSamples.load(path)
    split = {"train": ([], []), "held_out": ([], [])}
    for sample, taps in zip(tapped.samples, tapped.taps):
        part = split["held_out" if _is_heldout(sample.id, cfg.eval_fraction) else "train"]
        part[0].append(sample)
        part[1].append(taps)
    return split["train"], split["held_out"]


def _regenerate_and_tap(cfg: DataConfig, target, layer_ids: list[int], seed: int, log, heartbeat):
    from dflash_train.data.conversations import read_conversations
    from dflash_train.data.regen_taps import regenerate_with_taps

    if cfg.format == "text":  # base models: plain-text continuations (data/text.py)
        from dflash_train.data.text import continuations_with_taps

        return _checked_tapped(cfg, *continuations_with_taps(cfg, target, layer_ids, seed, log, heartbeat), log)
    conversations, bad = read_conversations(cfg.train, skip_bad_rows=cfg.skip_bad_rows,
                                            max_samples=cfg.max_samples, seed=seed)
    log(f"data: {len(conversations)} conversations from {cfg.train}; {bad.summary()}")
    tapped, report = regenerate_with_taps(target, conversations, layer_ids, cfg.regen_max_new_tokens,
                                          cfg.regen_batch_size, cfg.max_len, cfg.thinking, cfg.min_loss_tokens,
                                          heartbeat=heartbeat)
    return _checked_tapped(cfg, tapped, report, log)


def _checked_tapped(cfg: DataConfig, tapped, report: dict, log):
    log(f"data: regenerated and tapped {report['samples']} samples, {report['new_tokens']} new tokens in "
        f"{report['seconds']:.0f}s ({report['new_tokens'] / max(report['seconds'], 1e-9):.0f} tok/s); "
        f"skipped {report['skipped']}")
    if not tapped.samples:
        raise ValueError(f"data {cfg.train!r}: regeneration left no usable sample ({report['skipped']})")
    return tapped


def load_samples(path: Path, eval_fraction: float) -> tuple[list[Sample], list[Sample]]:
    train, held_out = [], []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        sample = Sample(row["id"], tuple(row["input_ids"]), tuple(row["loss_mask"]))
        (held_out if _is_heldout(sample.id, eval_fraction) else train).append(sample)
    return train, held_out
