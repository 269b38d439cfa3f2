"""From `data.train` to tokenized training and held-out samples, cached on disk.

Order: read conversations (bad rows: error with location, or counted with --skip-bad-rows);
optionally regenerate the assistant turns with the target (append-only, resumable cache); tokenize
with the target's chat template and an assistant-only loss mask; split off a held-out fraction by
a hash of the id (stable whatever the sample count). The tokenized result is cached as JSONL keyed
by everything it depends on, written atomically by the main process; other ranks wait and read it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from pathlib import Path

from dflash_train import atomic
from dflash_train.config import DataConfig
from dflash_train.train.batching import Sample


def _is_heldout(sample_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=4).digest(), "little")
    return h / 2**32 < fraction


def cache_key(cfg: DataConfig, target_name: str, seed: int) -> str:
    parts = json.dumps([train_key(cfg), cfg.max_len, cfg.min_loss_tokens, cfg.thinking, cfg.max_samples, cfg.regenerate,
                        cfg.regen_max_new_tokens, target_name, seed, 2], sort_keys=True)
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def prepare_samples(cfg: DataConfig, target, target_name: str, work_dir: Path, seed: int, log=print,
                    heartbeat=None) -> Path:
    """Build the tokenized sample cache (main process only) and return its path."""
    from dflash_train.data.conversations import tokenize_conversations

    path = work_dir / f"samples-{cache_key(cfg, target_name, seed)}.jsonl"
    if path.exists():
        log(f"data: using cached samples {path}")
        return path
    conversations, bad = read_train_conversations(cfg, target, target_name, work_dir, seed, log, heartbeat)
    log(f"data: {len(conversations)} conversations from {cfg.train}; {bad.summary()}")
    if cfg.regenerate:
        conversations = regenerate_cached(cfg, target, target_name, conversations, work_dir, seed, log, heartbeat)
    samples, bad = tokenize_conversations(target.tokenizer, conversations, cfg.max_len, cfg.min_loss_tokens,
                                          cfg.thinking, bad)
    log(f"data: {len(samples)} tokenized samples; {bad.summary()}")
    if not samples:
        raise ValueError(f"data {cfg.train!r}: no usable samples ({bad.summary()})")
    atomic.write_text(path, "".join(json.dumps({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask})
                                    + "\n" for s in samples))
    return path


def regenerate_cached(cfg: DataConfig, target, target_name: str, conversations, work_dir: Path, seed: int, log,
                      heartbeat=None):
    """Responses by the target (greedy), cached in an append-only file that resumes."""
    from dflash_train.data.conversations import Conversation
    from dflash_train.data.regenerate import regenerate

    key = hashlib.sha256(json.dumps([train_key(cfg), target_name, cfg.regen_max_new_tokens, cfg.thinking,
                                     cfg.max_samples, seed]).encode()).hexdigest()[:16]
    out = work_dir / f"regenerated-{key}.jsonl"
    report = regenerate(target, conversations, out, max_new_tokens=cfg.regen_max_new_tokens,
                        batch_size=cfg.regen_batch_size, thinking=cfg.thinking, seed=seed,
                        on_batch=(lambda b: heartbeat(f"regenerate batch {b}")) if heartbeat else None)
    log(f"data: regenerated responses in {out} ({report})")
    wanted = {c.id for c in conversations}
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [Conversation(r["id"], r["messages"]) for r in rows if r["id"] in wanted]


def prepare_tapped(cfg: DataConfig, target, target_name: str, layer_ids: list[int], work_dir: Path, seed: int,
                   log=print, heartbeat=None):
    """Regenerate + tap in one pass (cached): (train samples, held-out samples, their taps)."""
    from dflash_train.data.regen_taps import TappedSamples, regenerate_with_taps

    path = work_dir / f"tapped-{cache_key(cfg, target_name, seed)}-{'_'.join(map(str, layer_ids))}.safetensors"
    if path.exists():
        log(f"data: using cached regenerated samples and taps {path}")
        tapped = TappedSamples.load(path)
    else:
        conversations, bad = read_train_conversations(cfg, target, target_name, work_dir, seed, log, heartbeat)
        log(f"data: {len(conversations)} conversations from {cfg.train}; {bad.summary()}")
        tapped, report = regenerate_with_taps(target, conversations, layer_ids, cfg.regen_max_new_tokens,
                                              cfg.regen_batch_size, cfg.max_len, cfg.thinking, cfg.min_loss_tokens,
                                              heartbeat=heartbeat)
        log(f"data: regenerated and tapped {report['samples']} samples, {report['new_tokens']} new tokens in "
            f"{report['seconds']:.0f}s ({report['new_tokens'] / max(report['seconds'], 1e-9):.0f} tok/s); "
            f"skipped {report['skipped']}")
        if not tapped.samples:
            raise ValueError(f"data {cfg.train!r}: regeneration left no usable sample ({report['skipped']})")
        work_dir.mkdir(parents=True, exist_ok=True)
        tapped.save(path)
    split = {"train": ([], []), "held_out": ([], [])}
    for sample, taps in zip(tapped.samples, tapped.taps):
        part = split["held_out" if _is_heldout(sample.id, cfg.eval_fraction) else "train"]
        part[0].append(sample)
        part[1].append(taps)
    return split["train"], split["held_out"]


def load_samples(path: Path, eval_fraction: float) -> tuple[list[Sample], list[Sample]]:
    train, held_out = [], []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        sample = Sample(row["id"], tuple(row["input_ids"]), tuple(row["loss_mask"]))
        (held_out if _is_heldout(sample.id, eval_fraction) else train).append(sample)
    return train, held_out


# ---------------------------------------------------------------------------------------------
# Sources of `data.train`: one source, or a mix by weight


SYNTHESIZE = "synthesize"
NAMED_SOURCES = ("default", "chitchat", SYNTHESIZE)


def parse_train_spec(spec: str, max_samples: int | None) -> list[tuple[str, int | None]]:
    """`data.train` as (source, sample count) pairs, validated before anything heavy loads.

    Syntax: one source (`default`, `chitchat`, `synthesize`, a JSONL/parquet file or an HF dataset
    directory), or a mix `source:weight,source:weight,...` (a missing weight is 1). A mix, and any
    spec with `synthesize`, needs `max_samples`: it is the total, split by weight (largest
    remainder, so the counts add up exactly). A spec naming an existing path is one source, even
    with a comma or colon in it.
    """
    if not spec.strip():
        raise ValueError("data.train is empty; expected a source or a mix like default:0.5,synthesize:0.5")
    parts = [spec] if Path(spec).expanduser().exists() else [p.strip() for p in spec.split(",")]
    shares = []
    for part in parts:
        name, weight = part, 1.0
        head, sep, tail = part.rpartition(":")
        if sep and re.fullmatch(r"[0-9]*\.?[0-9]+(e[-+]?[0-9]+)?", tail, re.IGNORECASE):
            name, weight = head.strip(), float(tail)
        if weight <= 0:
            raise ValueError(f"data.train={spec!r}: weight of {name!r} must be > 0")
        if name not in NAMED_SOURCES and not Path(name).expanduser().exists():
            raise ValueError(f"data.train={spec!r}: {name!r} is not a source ({', '.join(NAMED_SOURCES)}, "
                             "or an existing JSONL/parquet file or dataset directory)")
        shares.append((name, weight))
    names = [n for n, _ in shares]
    if len(set(names)) < len(names):
        raise ValueError(f"data.train={spec!r}: a source appears twice")
    if (len(shares) > 1 or SYNTHESIZE in names) and not max_samples:
        raise ValueError(f"data.train={spec!r} needs data.max_samples: the number of samples in all "
                         f"({'split by weight' if len(shares) > 1 else 'prompts the target writes'})")
    if len(shares) == 1:
        return [(names[0], max_samples)]
    total = sum(w for _, w in shares)
    exact = [max_samples * w / total for _, w in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[:max_samples - sum(counts)]:
        counts[i] += 1
    return list(zip(names, counts))


def train_key(cfg: DataConfig) -> str:
    """`data.train` for cache keys, plus the synthesis settings when the target writes prompts."""
    if SYNTHESIZE not in re.split(r"[,:]", cfg.train):
        return cfg.train
    synth = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.startswith("synth_")}
    return json.dumps([cfg.train, synth], sort_keys=True)


def read_train_conversations(cfg: DataConfig, target, target_name: str, work_dir: Path, seed: int, log=print,
                             heartbeat=None):
    """(conversations, bad-row report) of `data.train`: each source's share, shuffled together
    (seeded). One file or corpus source reads exactly as `read_conversations` does."""
    from dflash_train.data.conversations import BadRows, read_conversations

    sources = parse_train_spec(cfg.train, cfg.max_samples)
    if len(sources) == 1 and sources[0][0] != SYNTHESIZE:
        return read_conversations(cfg.train, skip_bad_rows=cfg.skip_bad_rows, max_samples=cfg.max_samples,
                                  seed=seed)
    conversations, bad = [], BadRows()
    for name, count in sources:
        if count == 0:
            log(f"data: {name}: weight gives 0 of {cfg.max_samples} samples; skipped")
            continue
        if name == SYNTHESIZE:
            got = synthesized_conversations(cfg, target, target_name, count, work_dir, seed, log, heartbeat)
        else:
            got, source_bad = read_conversations(name, skip_bad_rows=cfg.skip_bad_rows, max_samples=count, seed=seed)
            bad.merge(source_bad)
        log(f"data: {name}: {len(got)} of {count} conversations")
        conversations += got
    random.Random(seed).shuffle(conversations)
    return conversations, bad


def synthesized_conversations(cfg: DataConfig, target, target_name: str, count: int, work_dir: Path, seed: int,
                              log=print, heartbeat=None):
    """`count` one-turn conversations whose user prompt the target wrote (cached, resumable)."""
    from dflash_train.data.conversations import Conversation
    from dflash_train.data.synthesize import SynthSettings, synthesize_prompts

    settings = SynthSettings.from_config(cfg)
    key = hashlib.sha256(json.dumps([target_name, seed, dataclasses.asdict(settings)]).encode()).hexdigest()[:16]
    cache = work_dir / f"synthesized-{key}.jsonl"
    log(f"data: the target writes {count} prompts (cache {cache})")
    prompts, _ = synthesize_prompts(target, count, seed, cache, settings, log=log,
                                    on_batch=(lambda b: heartbeat(f"synthesize batch {b}")) if heartbeat else None)
    return [Conversation(f"synth-{i:06d}", [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
