"""Conversations: reading (JSONL, HF datasets, parquet, the default corpus), validation, and
tokenization with the target's own chat template plus the loss mask.

Conventions:
- A conversation is a list of `{"role", "content"}` messages: an optional system message first,
  then user and assistant alternating, starting with user. It may end with a user turn (a prompt).
- The loss mask is 1 exactly on assistant tokens: each assistant message's content plus its
  end-of-turn token (e.g. `<|im_end|>`); 0 on role headers, system and user text, and template
  boilerplate such as an empty `<think></think>` block.
- Bad rows raise `DataError` naming file, 1-based line and field; with `skip_bad_rows` they are
  counted by reason in a `BadRows` report instead. Rows are never dropped silently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

from dflash_train.data import corpus
from dflash_train.data.code_requests import code_train_conversations
from dflash_train.data.records import Conversation, TokenizedSample
from dflash_train.data.rows import BadRows, DataError, parse_rows
from dflash_train.data.train_spec import CODE

# ---------------------------------------------------------------------------------------------
# Readers


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line, row) per non-blank line; a line that is not UTF-8 or not JSON is a DataError row (read as
    bytes and decoded line by line, so one bad byte names its line and can be skipped)."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, DataError(path.name, line_no, None, f"not UTF-8: byte 0x{raw[e.start]:02x} at column "
                                         f"{e.start + 1} (save the file as UTF-8)", "bad_utf8")
                continue
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as e:
                yield line_no, DataError(path.name, line_no, None, f"bad JSON: {e.msg} (column {e.colno})",
                                         "bad_json")


def _hf_dataset_rows(path: Path) -> Iterator[tuple[int, object]]:
    try:  # local: an optional dependency, needed only for this input format
        import datasets
    except ImportError as e:
        raise ImportError(f"{path} is an HF dataset directory; reading it needs the 'datasets' package: "
                          "pip install 'dflash-train[datasets]'") from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    for i, row in enumerate(ds, 1):
        yield i, row


def _parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    try:  # local: an optional dependency, needed only for this input format
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install 'dflash-train[datasets]'") from e
    for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
        yield i, row


def file_rows(spec: str) -> Iterator[tuple[int, object]]:
    """(line or row number, row) of a data file: an HF dataset directory, a parquet or a JSONL file."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return _hf_dataset_rows(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.is_file():
        return _jsonl_rows(path)
    raise FileNotFoundError(f"data {spec!r}: not 'default', 'chitchat', 'code', a file or a dataset directory")


def read_conversations(spec: str, skip_bad_rows: bool = False, max_samples: int | None = None,
                       seed: int = 0) -> tuple[list[Conversation], BadRows]:
    """Read conversations from `default` (the embedded corpus), `chitchat` (its human multi-turn
    conversations), `code` (requests built from the stdlib's functions: data/code_requests.py), a JSONL
    file, a parquet file, or an HF dataset saved to disk."""
    bad = BadRows()
    if spec == CODE:
        return code_train_conversations(seed=seed, max_samples=max_samples), bad
    if spec in ("default", "chitchat"):
        if spec == "default":
            return corpus.default_train_conversations(seed=seed, max_samples=max_samples), bad
        convs = corpus.chitchat_conversations(split="train")
        return convs[:max_samples] if max_samples else convs, bad
    path = Path(spec).expanduser()
    rows = file_rows(spec)
    convs: list[Conversation] = []
    for conv in parse_rows(rows, path.name, skip_bad_rows, bad):
        convs.append(conv)
        if max_samples and len(convs) >= max_samples:
            break
    return convs, bad


# ---------------------------------------------------------------------------------------------
# Tokenization and loss mask


def prompt_messages(messages: list[dict]) -> list[dict]:
    """Everything up to and including the last user turn (a final assistant turn is dropped)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError("no user message: a conversation needs one to have a prompt to answer")
    return [dict(m) for m in messages[: users[-1] + 1]]


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False,
                thinking: bool | None = None) -> str:
    """The target's chat template as text; `thinking` sets `enable_thinking` where the template
    reads it (ignored otherwise, so one setting works for every target)."""
    kwargs = {}
    if thinking is not None and "enable_thinking" in str(getattr(tokenizer, "chat_template", "") or ""):
        kwargs["enable_thinking"] = thinking
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)


def chat_record(tokenizer, data_format: str, thinking: bool | None) -> dict:
    """How prompts were rendered for regeneration, training and eval (one `render_chat`, one setting):
    recorded in the export (`dflash_config.training_input`) and printed with the serve commands, so a
    server renders requests the same way (published pitfall 5: a drafter trained without thinking served
    behind a thinking template drops from 60 % to 25 % acceptance, z-lab #133)."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    return {"format": data_format, "thinking": thinking,
            "thinking_read_by_template": "enable_thinking" in template,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16] if template else None}


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def _assistant_spans(tokenizer, messages: list[dict], full: str, thinking: bool | None) -> list[tuple[int, int]]:
    """Character spans of each assistant content inside the full rendering.

    The search for message k starts where the rendered prefix `messages[:k]` + generation prompt
    ends when that is a prefix of `full` (exact, skips the role header); otherwise (templates that
    re-render history, e.g. Qwen3 think blocks) after the previous message's content.
    """
    spans, cursor = [], 0
    for k, msg in enumerate(messages):
        start = cursor
        if msg["role"] == "assistant":
            header = render_chat(tokenizer, messages[:k], add_generation_prompt=True, thinking=thinking)
            if full.startswith(header):
                start = max(start, len(header))
        content = msg["content"] if msg["content"] in full[start:] else msg["content"].strip()
        pos = full.find(content, start)
        if pos < 0:
            raise ValueError(f"the chat template altered message {k} ({msg['role']}); cannot place the loss mask")
        cursor = pos + len(content)
        if msg["role"] == "assistant":
            spans.append((pos, cursor))
    return spans


def _mark_span(mask: list[int], full: str, offsets, token_ids, span: tuple[int, int],
               specials: set[int]) -> None:
    """Set mask=1 on tokens overlapping `span`, then on the end-of-turn special token that follows
    (whitespace-only tokens in between included); stop without one at ordinary text."""
    lo, hi = span
    last = -1
    for t, (a, b) in enumerate(offsets):
        if a < hi and b > lo:
            mask[t], last = 1, t
    if last < 0:
        return
    pending = []
    for t in range(last + 1, len(offsets)):
        if token_ids[t] in specials:
            for p in pending + [t]:
                mask[p] = 1
            return
        a, b = offsets[t]
        if full[a:b].strip():
            return
        pending.append(t)


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int,
                          thinking: bool | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the chat-template rendering and a loss mask that is 1 exactly on assistant
    content plus its end-of-turn token; both truncated to `max_len`."""
    full = render_chat(tokenizer, messages, thinking=thinking)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    mask = [0] * len(ids)
    specials = _special_ids(tokenizer)
    for span in _assistant_spans(tokenizer, messages, full, thinking):
        _mark_span(mask, full, offsets, ids, span, specials)
    return ids[:max_len], mask[:max_len]


def tokenize_conversations(tokenizer, conversations: Iterable[Conversation], max_len: int,
                           min_loss_tokens: int = 2, thinking: bool | None = None,
                           bad: BadRows | None = None) -> tuple[list[TokenizedSample], BadRows]:
    """Tokenize many; samples with fewer than `min_loss_tokens` supervised tokens (after
    truncation) are skipped and counted in the returned report, never dropped silently."""
    bad = bad if bad is not None else BadRows()
    out = []
    for conv in conversations:
        try:
            ids, mask = tokenize_conversation(tokenizer, conv.messages, max_len, thinking)
        except ValueError as err:
            bad.add("template_mismatch", f"{conv.id}: {err}")
            continue
        if sum(mask) < min_loss_tokens:
            bad.add("too_few_loss_tokens", f"{conv.id}: {sum(mask)} supervised tokens < {min_loss_tokens}")
            continue
        out.append(TokenizedSample(conv.id, ids, mask))
    return out, bad
