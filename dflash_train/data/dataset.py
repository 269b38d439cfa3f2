"""From `data.train` to tokenized training and held-out samples, cached on disk.

Order: resolve `data.format=auto` from the tokenizer (chat with a chat template, else plain-text
continuations, data/text.py); read conversations (bad rows: error with location, or counted with --skip-bad-rows);
optionally regenerate the assistant turns with the target (append-only, resumable cache); tokenize
with the target's chat template and an assistant-only loss mask; split off a held-out fraction by
a hash of the id (stable whatever the sample count). The tokenized result is cached as JSONL keyed
by everything it depends on, built once (dflash_train.cache: a file lock, an atomic rename) by the main
process; other ranks wait and read it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from pathlib import Path
from typing import Sequence, TypeVar

from dflash_train import cache
from dflash_train.config import DataConfig
from dflash_train.data import code_requests
from dflash_train.data.conversations import read_conversations, tokenize_conversations
from dflash_train.data.records import Conversation, Sample
from dflash_train.data.regen_taps import TappedSamples, regenerate_with_taps
from dflash_train.data.regenerate import regenerate
from dflash_train.data.rows import BadRows
from dflash_train.data.synthesize import SynthSettings, synthesize_prompts
from dflash_train.data.train_spec import CODE, NAMED_SOURCES, SYNTHESIZE, parse_train_spec
from dflash_train.data.text import continuation_samples, continuations_with_taps, resolve_data_format

Paired = TypeVar("Paired")


def is_held_out(sample_id: str, fraction: float) -> bool:
    """The held-out split of every data route (samples, tap cache, shards): a hash of the sample id,
    so a sample stays on its side whatever the sample count or order."""
    h = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=4).digest(), "little")
    return h / 2**32 < fraction


def split_held_out(samples: Sequence[Sample], fraction: float, paired: Sequence[Paired] | None = None
                   ) -> tuple[tuple[list[Sample], list[Paired]], tuple[list[Sample], list[Paired]]]:
    """`((train samples, their paired items), (held-out samples, theirs))` by `is_held_out`;
    `paired` (e.g. taps) runs alongside `samples` and defaults to the sample indices."""
    paired = range(len(samples)) if paired is None else paired
    split = {False: ([], []), True: ([], [])}
    for sample, item in zip(samples, paired, strict=True):
        part = split[is_held_out(sample.id, fraction)]
        part[0].append(sample)
        part[1].append(item)
    return split[False], split[True]


def resolved(cfg: DataConfig, tokenizer, target_name: str = "target") -> DataConfig:
    """`cfg` with `data.format=auto` resolved from the tokenizer (`text.resolve_data_format`): a training
    run resolves it once when the tokenizer loads; library callers that pass `auto` get the same answer."""
    if cfg.format != "auto":
        return cfg
    return dataclasses.replace(cfg, format=resolve_data_format(cfg.format, tokenizer, target_name)[0])


def cache_key(cfg: DataConfig, target_name: str, seed: int) -> str:
    """The key of a data cache; its callers pass a resolved `data.format` (chat keys as before it existed)."""
    parts = json.dumps([train_key(cfg), cfg.max_len, cfg.min_loss_tokens, cfg.thinking, cfg.max_samples, cfg.regenerate,
                        cfg.regen_max_new_tokens, target_name, seed, 2]
                       + ([cfg.format, cfg.text_prompt_tokens] if cfg.format != "chat" else []), sort_keys=True)
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def prepare_samples(cfg: DataConfig, target, target_name: str, work_dir: Path, seed: int, log=print,
                    heartbeat=None) -> Path:
    """Build the tokenized sample cache once (a concurrent job waits on its lock) and return its path."""
    cfg = resolved(cfg, target.tokenizer, target_name)
    path = work_dir / f"samples-{cache_key(cfg, target_name, seed)}.jsonl"
    def build(tmp: Path) -> None:
        _tokenize_into(tmp, cfg, target, target_name, work_dir, seed, log, heartbeat)

    if not cache.build_once(path, build, f"tokenized samples {path.name}", directory=False, log=log, verify=True):
        log(f"data: using cached samples {path} (content checked against its record)")
    return path


def _tokenize_into(out: Path, cfg: DataConfig, target, target_name: str, work_dir: Path, seed: int, log,
                   heartbeat) -> None:
    if cfg.format == "text":  # base models: plain-text continuations (data/text.py)
        return _write_samples(out, continuation_samples(cfg, target, seed, log, heartbeat), cfg)
    conversations, bad = read_train_conversations(cfg, target, target_name, work_dir, seed, log, heartbeat)
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
    key = hashlib.sha256(json.dumps([train_key(cfg), target_name, cfg.regen_max_new_tokens, cfg.thinking,
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
                   log=print, heartbeat=None, final_hidden: bool = False):
    """Regenerate + tap in one pass (cached; a concurrent job waits on its lock): the `TappedSamples` and
    ((train samples, their indices in it), (held-out samples, theirs)); `final_hidden` also keeps the target's
    final hidden state (a distillation loss), in a cache file of its own."""
    cfg = resolved(cfg, target.tokenizer, target_name)
    suffix = "-final" if final_hidden else ""
    path = work_dir / f"tapped-{cache_key(cfg, target_name, seed)}-{'_'.join(map(str, layer_ids))}{suffix}.safetensors"

    def build(tmp: Path) -> None:
        _regenerate_and_tap(cfg, target, target_name, layer_ids, work_dir, seed, log, heartbeat, final_hidden).save(
            tmp, durable=False)  # build_once renames it, hashed, into place

    if not cache.build_once(path, build, f"regenerated samples and taps {path.name}", directory=False, log=log,
                            verify=True):
        log(f"data: using cached regenerated samples and taps {path} (content checked against its record)")
    tapped = TappedSamples.load(path)
    return tapped, split_held_out(tapped.samples, cfg.eval_fraction)


def _regenerate_and_tap(cfg: DataConfig, target, target_name: str, layer_ids: list[int], work_dir: Path, seed: int,
                        log, heartbeat, final_hidden: bool = False):
    if cfg.format == "text":  # base models: plain-text continuations (data/text.py)
        return _checked_tapped(cfg, *continuations_with_taps(cfg, target, layer_ids, seed, log, heartbeat,
                                                             final_hidden), log)
    conversations, bad = read_train_conversations(cfg, target, target_name, work_dir, seed, log, heartbeat)
    log(f"data: {len(conversations)} conversations from {cfg.train}; {bad.summary()}")
    tapped, report = regenerate_with_taps(target, conversations, layer_ids, cfg.regen_max_new_tokens,
                                          cfg.regen_batch_size, cfg.max_len, cfg.thinking, cfg.min_loss_tokens,
                                          heartbeat=heartbeat, final_hidden=final_hidden)
    return _checked_tapped(cfg, tapped, report, log)


def _checked_tapped(cfg: DataConfig, tapped, report: dict, log):
    log(f"data: regenerated and tapped {report['samples']} samples, {report['new_tokens']} new tokens in "
        f"{report['seconds']:.0f}s ({report['new_tokens'] / max(report['seconds'], 1e-9):.0f} tok/s); "
        f"skipped {report['skipped']}")
    if not tapped.samples:
        raise ValueError(f"data {cfg.train!r}: regeneration left no usable sample ({report['skipped']})")
    return tapped


def load_samples(path: Path, eval_fraction: float, vocab_size: int | None = None
                 ) -> tuple[list[Sample], list[Sample]]:
    """The cached tokenized samples of `prepare_samples`, split into (train, held-out). A row that is
    not a sample (a damaged cache), or a token id outside [0, vocab_size), is a ValueError naming the
    file, the line and the field."""
    samples = [_sample_row(path, number, line, vocab_size)
               for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)]
    (train, _), (held_out, _) = split_held_out(samples, eval_fraction)
    return train, held_out


def _sample_row(path: Path, number: int, line: str, vocab_size: int | None) -> Sample:
    where, fix = f"{path}:{number}", f"the cache is damaged: delete {path} and it is rebuilt"
    try:
        row = json.loads(line)
        sample = Sample(row["id"], tuple(row["input_ids"]), tuple(row["loss_mask"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a tokenized sample ({type(e).__name__}: {e}); {fix}") from None
    bad = [t for t in sample.input_ids if type(t) is not int or not 0 <= t < (vocab_size or float("inf"))]
    if bad:
        raise ValueError(f"{where}: field input_ids: token id {bad[0]!r} is outside the target's vocabulary "
                         f"[0, {vocab_size}); {fix} (or the samples were made for another tokenizer)")
    if len(sample.loss_mask) != len(sample.input_ids):
        raise ValueError(f"{where}: field loss_mask: {len(sample.loss_mask)} entries for {len(sample.input_ids)} "
                         f"tokens; {fix}")
    return sample


# ---------------------------------------------------------------------------------------------
# Sources of `data.train`: one source, or a mix by weight


def train_key(cfg: DataConfig) -> str:
    """`data.train` for cache keys: each source by its content (a file's sha256, never its name: an
    edited file is rebuilt, a renamed one is the same) and its share, plus the synthesis settings
    when the target writes prompts."""
    sources = [(_content_of(name), count) for name, count in parse_train_spec(cfg.train, cfg.max_samples)]
    if SYNTHESIZE not in re.split(r"[,:]", cfg.train):
        return json.dumps(sources)
    synth = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.startswith("synth_")}
    return json.dumps([sources, synth], sort_keys=True)


def _content_of(source: str) -> str:
    """A named source as is; a file or dataset directory as the sha256 of its files' contents."""
    path = Path(source).expanduser()
    if source == CODE:
        return code_requests.fingerprint()  # built from this interpreter's stdlib: another Python, other prompts
    if source in NAMED_SOURCES or not path.exists():
        return source
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    parts = [f"{p.relative_to(path) if path.is_dir() else ''}|{cache.file_sha256(p)}" for p in files]
    return "sha256:" + hashlib.sha256(";".join(parts).encode()).hexdigest()[:16]


def read_train_conversations(cfg: DataConfig, target, target_name: str, work_dir: Path, seed: int, log=print,
                             heartbeat=None):
    """(conversations, bad-row report) of `data.train`: each source's share, shuffled together
    (seeded). One file or corpus source reads exactly as `read_conversations` does."""
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
    settings = SynthSettings.from_config(cfg)
    key = hashlib.sha256(json.dumps([target_name, seed, dataclasses.asdict(settings)]).encode()).hexdigest()[:16]
    cache_path = work_dir / f"synthesized-{key}.jsonl"
    log(f"data: the target writes {count} prompts (cache {cache_path})")
    prompts, _ = synthesize_prompts(target, count, seed, cache_path, settings, log=log,
                                    on_batch=(lambda b: heartbeat(f"synthesize batch {b}")) if heartbeat else None)
    return [Conversation(f"synth-{i:06d}", [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
