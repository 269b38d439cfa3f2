"""Prompts written by the target itself (the "Magpie" technique, Xu et al. 2024).

An instruction-tuned model, given its chat template up to an open user turn (the default system
turn if the template adds one, then the user header, nothing else) and sampled, writes a user
request drawn from the distribution it was tuned on. That gives any chat target an unlimited
prompt source in its own users' distribution, with no dataset; the target then answers the
prompts as usual (`regenerate`).

Mechanics:
- The pre-query prefix is found generically: render a one-message conversation whose user content
  is a unique placeholder and cut at the placeholder. No chat template, or a template that does
  not render the user content, is refused with the reason (a base model cannot write prompts this
  way; it trains on text continuation instead).
- Every row of a batch has the same prompt (the prefix), so there is no padding. Batch b is sampled
  with a seed derived from (stream, seed, b): a rerun, a resumed run and a run asked for more
  prompts all see the same outputs in the same order. `stream` separates training prompts from
  held-out ones (`synthesized_eval_prompts`): the two never share a sampling seed.
- Raw outputs are cached per batch (the whole file rewritten atomically after each batch), so an
  interrupted run continues from its last complete batch. Filters and de-duplication run on the
  raw outputs in order, deterministically, and their drop counts are reported by reason.

Limits: single-turn prompts only; prompts from a small target are sometimes odd (about 20 of 24
were genuine requests on SmolLM2-135M-Instruct); the held-out stream is a disjoint sample of the
same distribution, so a common short request can occur in both (pass `exclude` to drop those).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from dflash_train import atomic
from dflash_train.config import DataConfig
from dflash_train.data import graph_decode
from dflash_train.data.regenerate import end_of_turn_ids, pad_id

PLACEHOLDER = "\u27e6DFLASH-USER-PROMPT-7f3a\u27e7"  # never produced by a template or a user
CACHE_VERSION = 1
MAX_OUTPUTS_PER_PROMPT = 4
"""Give up (with the drop counts) after sampling this many outputs per wanted prompt."""
DROP_REASONS = ("empty", "did_not_end_turn", "too_short", "too_long", "excluded", "exact_duplicate",
                "near_duplicate")


class NoUserTurnError(ValueError):
    """The target's tokenizer cannot render an open user turn, so it cannot write prompts."""


@dataclass(frozen=True, kw_only=True)
class SynthSettings:
    """The sampling, filter and de-duplication settings; defaults come from `DataConfig`."""

    max_new_tokens: int
    temperature: float
    top_p: float
    batch_size: int
    min_words: int
    max_words: int
    near_dup_jaccard: float

    @classmethod
    def from_config(cls, cfg: DataConfig | None = None) -> "SynthSettings":
        cfg = cfg or DataConfig()
        return cls(max_new_tokens=cfg.synth_max_new_tokens, temperature=cfg.synth_temperature,
                   top_p=cfg.synth_top_p, batch_size=cfg.synth_batch_size, min_words=cfg.synth_min_words,
                   max_words=cfg.synth_max_words, near_dup_jaccard=cfg.synth_near_dup_jaccard)


@dataclass
class SynthReport:
    """Outputs sampled, prompts kept, and drops counted by reason (see `DROP_REASONS`)."""

    wanted: int
    sampled: int = 0
    """Outputs in the cache after the run (kept + dropped + sampled beyond the need)."""
    kept: int = 0
    batches: int = 0
    cached_batches: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    dropped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        drops = ", ".join(f"{r} {self.dropped[r]}" for r in DROP_REASONS if self.dropped[r]) or "none"
        unused = self.sampled - self.kept - sum(self.dropped.values())
        return (f"{self.kept} prompts kept of {self.sampled} sampled in {self.batches} batches "
                f"({self.cached_batches} from the cache, {unused} sampled beyond the need); dropped: {drops}")


# ---------------------------------------------------------------------------------------------
# The pre-query template


def pre_query_prefix(tokenizer) -> str:
    """The chat template rendered up to the content of an opening user turn (default system turn
    included when the template adds one). Raises `NoUserTurnError` naming the reason."""
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise NoUserTurnError(
            f"tokenizer {name!r} has no chat template: a base model cannot write user prompts from a "
            "pre-query template (there is no user turn to open). Train a base model on text "
            "continuation instead, or give data.train a file of prompts.")
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False,
                                             add_generation_prompt=False)
    except Exception as e:  # a template may raise anything (jinja TemplateError, its own raise_exception)
        raise NoUserTurnError(f"tokenizer {name!r}: the chat template failed on a single user turn "
                              f"({type(e).__name__}: {e}); it cannot open a user turn for prompts") from e
    cut = text.find(PLACEHOLDER)
    if cut < 0:
        raise NoUserTurnError(f"tokenizer {name!r}: the chat template has no user turn (a user message's "
                              "content does not appear in its rendering), so the target cannot write prompts")
    return text[:cut]


# ---------------------------------------------------------------------------------------------
# Filters and de-duplication


def normalize(text: str) -> str:
    """Lower-case words only: the key of exact duplicates."""
    return " ".join(re.findall(r"\w+", text.lower()))


def word_shingles(text: str, n: int = 3) -> frozenset:
    words = normalize(text).split()
    if len(words) < n:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def drop_reason(text: str, ended: bool, min_words: int, max_words: int) -> str | None:
    """Why one output is not a usable prompt (None: usable)."""
    if not text.strip():
        return "empty"
    if not ended:
        return "did_not_end_turn"
    words = len(text.split())
    if words < min_words:
        return "too_short"
    if words > max_words:
        return "too_long"
    return None


class Deduper:
    """First-come de-duplication: exact (same `normalize` key) and near duplicates (Jaccard of word
    3-gram sets >= threshold against any kept text), computed exactly through an inverted index
    of shingles, so the cost is the shared shingles, not all pairs."""

    def __init__(self, threshold: float, exclude: Iterable[str] = ()):
        self.threshold = threshold
        self.keys: set[str] = set()
        self.sets: list[frozenset] = []
        self.index: dict[tuple, list[int]] = {}
        self.excluded = {normalize(t) for t in exclude}

    def reason(self, text: str) -> str | None:
        """None and remember `text`, or the reason it duplicates an earlier text."""
        key = normalize(text)
        if key in self.excluded:
            return "excluded"
        if key in self.keys:
            return "exact_duplicate"
        shingles = word_shingles(text)
        shared = Counter(j for s in shingles for j in self.index.get(s, ()))
        for j, common in shared.items():
            if common / (len(shingles) + len(self.sets[j]) - common) >= self.threshold:
                return "near_duplicate"
        self.keys.add(key)
        for s in shingles:
            self.index.setdefault(s, []).append(len(self.sets))
        self.sets.append(shingles)
        return None


class Selector:
    """Filters then de-duplicates raw outputs `{"text", "ended"}` in the order fed, keeping up to
    `n` prompts; drops are counted by reason. Outputs fed after `n` are kept are left unused."""

    def __init__(self, n: int, settings: SynthSettings, exclude: Iterable[str] = ()):
        self.n, self.settings = n, settings
        self.dedupe = Deduper(settings.near_dup_jaccard, exclude)
        self.kept: list[str] = []
        self.dropped: Counter = Counter()

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.n

    def feed(self, outputs: Iterable[dict]) -> None:
        s = self.settings
        for out in outputs:
            if self.done:
                return
            text = out["text"].strip()
            why = drop_reason(text, out["ended"], s.min_words, s.max_words) or self.dedupe.reason(text)
            if why:
                self.dropped[why] += 1
            else:
                self.kept.append(text)


# ---------------------------------------------------------------------------------------------
# Sampling


def batch_seed(stream: str, seed: int, batch: int) -> int:
    digest = hashlib.blake2b(f"{stream}:{seed}:{batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def fixed_shape_sampler(target, settings: SynthSettings, stop_ids: list[int]):
    """On a GPU, for a target the fixed-shape decoder supports: a `GraphDecoder` that samples
    (data/graph_decode.py; HF `generate` is host-bound there); else None (HF `generate`)."""
    if target.device.type != "cuda" or not graph_decode.supports(target.model):
        return None
    return graph_decode.GraphDecoder(target.model, lambda hidden: {}, settings.batch_size, stop_ids,
                                     pad_id(target, stop_ids), use_graph=True,
                                     sampling=(settings.temperature, settings.top_p))


@torch.no_grad()
def sample_batch(target, prefix_ids: list[int], settings: SynthSettings, stop_ids: list[int],
                 seed: int, sampler=None) -> list[dict]:
    """One batch of continuations of the prefix: `{"text", "ended", "new_tokens"}` per row; drawn by
    `sampler` (`fixed_shape_sampler`) when given, else by HF `generate`."""
    devices = [target.device] if target.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # seeded, without disturbing the caller's RNG
        torch.manual_seed(seed)
        if sampler is not None:
            new_rows = sampler.decode([list(prefix_ids)] * settings.batch_size, settings.max_new_tokens)[0]
        else:
            ids = torch.tensor([prefix_ids] * settings.batch_size, device=target.device)  # (b, P), no padding
            out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                        temperature=settings.temperature, top_p=settings.top_p, top_k=0,
                                        max_new_tokens=settings.max_new_tokens, eos_token_id=stop_ids,
                                        pad_token_id=pad_id(target, stop_ids))
            new_rows = out[:, ids.shape[1]:].tolist()  # (b, new)
    rows = []
    for row in new_rows:
        stop = next((i for i, t in enumerate(row) if t in stop_ids), None)
        tokens = row if stop is None else row[:stop]
        rows.append({"text": target.tokenizer.decode(tokens, skip_special_tokens=True),
                     "ended": stop is not None, "new_tokens": len(tokens)})
    return rows


def _read_cache(path: Path, header: dict) -> list[list[dict]]:
    """Cached batches (outputs per batch); a header from other settings is an error."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    found = json.loads(lines[0]) if lines else None
    if found != header:
        raise ValueError(f"{path}: written with other settings or another target ({found!r:.300}); "
                         f"expected {header!r:.300}. Remove it or use another cache path")
    batches = [json.loads(line) for line in lines[1:]]
    for b, row in enumerate(batches):
        if row.get("batch") != b:
            raise ValueError(f"{path}:{b + 2}: expected batch {b}, found {row.get('batch')!r}")
    return [row["outputs"] for row in batches]


def _write_cache(path: Path, header: dict, batches: list[list[dict]]) -> None:
    lines = [json.dumps(header, ensure_ascii=False)]
    lines += [json.dumps({"batch": b, "outputs": outs}, ensure_ascii=False) for b, outs in enumerate(batches)]
    atomic.write_text(path, "\n".join(lines) + "\n")


def synthesize_prompts(target, n: int, seed: int, cache_path: str | Path | None = None,
                       settings: SynthSettings | None = None, stream: str = "train", exclude: Iterable[str] = (),
                       log: Callable[[str], None] = print,
                       on_batch: Callable[[int], None] | None = None) -> tuple[list[str], SynthReport]:
    """`n` user prompts written by the target, and the report of what was sampled and dropped.

    Batches already in `cache_path` are reused, new ones appended (atomically, after each batch);
    `on_batch(b)` runs after batch b is durably cached. The same (target, settings, stream, seed)
    gives the same prompts, and the first k of a larger request equal a request for k.
    """
    settings = settings or SynthSettings.from_config()
    prefix = pre_query_prefix(target.tokenizer)
    prefix_ids = target.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    header = {"kind": "dflash-train synthesized prompts", "version": CACHE_VERSION, "target": target.name,
              "prefix": prefix, "stream": stream, "seed": seed, "settings": asdict(settings)}
    path = Path(cache_path) if cache_path is not None else None
    batches = _read_cache(path, header) if path is not None else []
    report = SynthReport(wanted=n, cached_batches=len(batches))
    selector = Selector(n, settings, exclude)
    for outs in batches:
        selector.feed(outs)
    stop_ids = end_of_turn_ids(target)
    sampler = fixed_shape_sampler(target, settings, stop_ids)
    max_batches = -(-MAX_OUTPUTS_PER_PROMPT * n // settings.batch_size) + 1
    t0 = time.perf_counter()
    bar = tqdm(total=n, initial=len(selector.kept), unit="prompt", desc="synthesize", dynamic_ncols=True)
    while not selector.done and len(batches) < max_batches:
        b = len(batches)
        batches.append(sample_batch(target, prefix_ids, settings, stop_ids, batch_seed(stream, seed, b), sampler))
        report.new_tokens += sum(o["new_tokens"] for o in batches[-1])
        if path is not None:
            _write_cache(path, header, batches)
        before = len(selector.kept)
        selector.feed(batches[-1])
        bar.update(len(selector.kept) - before)
        bar.set_postfix(sampled=sum(map(len, batches)), dropped=sum(selector.dropped.values()))
        if on_batch is not None:
            on_batch(b)
    bar.close()
    report.seconds = time.perf_counter() - t0
    report.batches, report.kept, report.dropped = len(batches), len(selector.kept), selector.dropped
    report.sampled = sum(map(len, batches))
    log(f"synthesize: {report.summary()}; {report.seconds:.0f}s")
    if not selector.done:
        raise RuntimeError(f"synthesize: only {report.kept} of {n} prompts ({report.summary()}); the target "
                           "rarely writes a usable prompt: check its chat template, or raise "
                           "data.synth_max_new_tokens")
    return selector.kept, report


def synthesized_eval_prompts(target, n: int, seed: int = 0, cache_path: str | Path | None = None,
                             settings: SynthSettings | None = None,
                             exclude: Iterable[str] = ()) -> list[list[dict]]:
    """Held-out self-written prompts: the `eval` stream, whose sampling seeds never meet the
    training stream's. Each entry is a message list ending with a user turn (like
    `corpus.default_eval_prompts`)."""
    prompts, _ = synthesize_prompts(target, n, seed, cache_path, settings, stream="eval", exclude=exclude)
    return [[{"role": "user", "content": p}] for p in prompts]
