"""The embedded default corpus: offline, deterministic, shipped with the installed packages.

Two sources:
- chitchat: the `chitchat-dataset` package's human conversations (7,168, MIT). Consecutive
  messages of one sender form a turn; the first sender is the user, the other the assistant.
  About 2% of conversations (chosen by a hash of their id, so stable) are held out for evaluation.
- assistant-style requests: templates x topics from `assistant_templates` (a few thousand) for
  training, and ~60 hand-written requests in `assistant_eval_prompts.jsonl` for evaluation,
  written independently of the templates and topics.

Training prompts carry no responses: `regenerate` has the target write them (spec 2.7).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from functools import lru_cache
from pathlib import Path

from dflash_train.data.assistant_templates import assistant_training_prompts
from dflash_train.data.records import Conversation
from dflash_train.data.rows import parse_row

CHITCHAT_HELDOUT_PER_MILLE = 20  # ~2% of conversations, by id hash
EVAL_PROMPTS_FILE = Path(__file__).with_name("assistant_eval_prompts.jsonl")
MIN_CHITCHAT_EVAL_CHARS = 20  # held-out chitchat prompts skip bare greetings ("hi", "Hello")
NUM_CHITCHAT_EVAL_PROMPTS = 60


def _chitchat_json_path() -> Path:
    """dataset.json inside the chitchat_dataset package, found without importing it."""
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default corpus needs the chitchat-dataset package: pip install chitchat-dataset")
    return Path(list(spec.submodule_search_locations)[0]) / "dataset.json"


def _chitchat_held_out(conv_key: str) -> bool:
    """The corpus's own split of conversations (fixed: the LOG's figures were measured on it),
    distinct from `dataset.is_held_out`, which splits tokenized samples of any source."""
    bucket = int(hashlib.sha256(conv_key.encode()).hexdigest()[:8], 16) % 1000
    return bucket < CHITCHAT_HELDOUT_PER_MILLE


def _chitchat_messages(raw: dict) -> list[dict]:
    """Merge consecutive same-sender messages into turns; map the first sender to user and the
    other to assistant (chitchat conversations have one or two senders)."""
    turns: list[tuple[str, list[str]]] = []
    for group in raw["messages"]:
        for msg in group:
            if turns and turns[-1][0] == msg["sender"]:
                turns[-1][1].append(msg["text"])
            else:
                turns.append((msg["sender"], [msg["text"]]))
    first_sender = turns[0][0]
    return [{"role": "user" if sender == first_sender else "assistant", "content": "\n".join(texts)}
            for sender, texts in turns]


@lru_cache(maxsize=1)
def _all_chitchat() -> tuple[tuple[str, bool, tuple], ...]:
    """(id, held_out, messages) for every non-empty chitchat conversation, in file order."""
    with open(_chitchat_json_path(), encoding="utf-8") as f:
        data = json.load(f)
    out = []
    for key, raw in data.items():
        if not raw.get("messages"):
            continue
        messages = _chitchat_messages(raw)
        out.append((f"chitchat-{key}", _chitchat_held_out(key), tuple(messages)))
    return tuple(out)


def chitchat_conversations(split: str = "train") -> list[Conversation]:
    """Full human multi-turn chitchat conversations of one split (`train` or `eval`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split {split!r}: expected train or eval")
    want_heldout = split == "eval"
    return [Conversation(cid, [dict(m) for m in msgs]) for cid, held, msgs in _all_chitchat()
            if held == want_heldout]


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


def _first_turn_prompts(split: str, min_chars: int = 1) -> list[Conversation]:
    """First-user-turn prompts of a chitchat split, de-duplicated by normalized text (many
    conversations open with the same "hello", and one greedy response per text is enough)."""
    seen, out = set(), []
    for conv in chitchat_conversations(split):
        text = conv.messages[0]["content"].strip()
        key = _normalize(text)
        if len(text) < min_chars or key in seen:
            continue
        seen.add(key)
        out.append(Conversation(conv.id, [{"role": "user", "content": text}]))
    return out


def assistant_train_conversations() -> list[Conversation]:
    return [Conversation(f"assistant-{i:05d}", [{"role": "user", "content": p}])
            for i, p in enumerate(assistant_training_prompts())]


def default_train_conversations(seed: int = 0, max_samples: int | None = None) -> list[Conversation]:
    """A seeded half/half mix of assistant-style prompts and chitchat first-user-turn prompts
    (each a one-message conversation ending with a user turn), shuffled; disjoint from
    the held-out prompts (`assistant_eval_prompts`, `chitchat_eval_prompts`). `max_samples` caps the total (half from each source)."""
    rng = random.Random(seed)
    assistant = assistant_train_conversations()
    chitchat = _first_turn_prompts("train")
    eval_texts = {_normalize(m[-1]["content"]) for m in assistant_eval_prompts() + chitchat_eval_prompts()}
    chitchat = [c for c in chitchat if _normalize(c.messages[0]["content"]) not in eval_texts]
    per_source = min(len(assistant), len(chitchat))
    if max_samples is not None:
        per_source = min(per_source, (max_samples + 1) // 2)
    mix = rng.sample(assistant, per_source) + rng.sample(chitchat, per_source)
    rng.shuffle(mix)
    return mix[:max_samples] if max_samples is not None else mix


def assistant_eval_prompts() -> list[list[dict]]:
    """The hand-written held-out requests (message lists ending with a user turn)."""
    out = []
    with open(EVAL_PROMPTS_FILE, encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            if text.strip():
                out.append(parse_row(json.loads(text), EVAL_PROMPTS_FILE.name, line_no).messages)
    return out


def chitchat_eval_prompts() -> list[list[dict]]:
    """First user turns of held-out chitchat conversations, de-duplicated, bare greetings skipped."""
    held_out = _first_turn_prompts("eval", MIN_CHITCHAT_EVAL_CHARS)
    return [c.messages for c in held_out[:NUM_CHITCHAT_EVAL_PROMPTS]]
