"""Plain-text continuation data for base models (targets without a chat template): `data.format=text`,
which `data.format=auto` (the default) picks by itself for a tokenizer without a chat template.

A document is tokenized as the target reads text (with its tokenizer's own special tokens, e.g. a
BOS) and split after `data.text_prompt_tokens` tokens (at most half the document) into a prompt and
a continuation. With `data.regenerate` the continuation is the target's own greedy one (up to
`data.regen_max_new_tokens` tokens: the drafter learns to predict the target's outputs, spec 2.7),
otherwise the document's own text. The loss mask is 1 on the continuation only.

Documents: rows with a `text` field in a JSONL file, a parquet file or a saved HF dataset (an `id`
field is kept); a `.txt` file, one document per blank-line-separated paragraph; or conversations
(`default`, `chitchat`, chat-shaped rows), whose message contents are joined by blank lines.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_train.config import DataConfig
from dflash_train.data.conversations import file_rows, read_conversations
from dflash_train.data.records import Conversation, TokenizedSample
from dflash_train.data.regen_taps import regenerate_prompts_with_taps
from dflash_train.data.regenerate import generate_batch, end_of_turn_ids
from dflash_train.data.rows import BadRows, DataError, content_id, json_type_name, parse_row
from dflash_train.data.train_spec import CORPUS_SOURCES

FORMATS = ("auto", "chat", "text")


@dataclass
class Document:
    id: str
    text: str


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_data_format(data_format: str, tokenizer, target_name: str) -> tuple[str, str]:
    """`(chat | text, why)` for `data.format`, run right after the target's tokenizer loads, before its
    weights: `auto` picks chat where the tokenizer has a chat template and text continuation where it has
    none (a base model); an explicit `chat` on a target without a template is an error naming why."""
    if data_format not in FORMATS:
        raise ValueError(f"data.format={data_format!r}: expected one of {', '.join(FORMATS)}")
    template = has_chat_template(tokenizer)
    if data_format == "chat" and not template:
        raise ValueError(f"target {target_name!r}: its tokenizer has no chat template (a base model?), and "
                         "data.format=chat renders conversations with it; set data.format=text (or auto) to train "
                         "on plain-text continuations instead")
    if data_format != "auto":
        return data_format, "data.format set explicitly"
    if template:
        return "chat", "the tokenizer has a chat template"
    return "text", "the tokenizer has no chat template (a base model)"


def check_data_format(data_format: str, tokenizer, target_name: str) -> None:
    """The commands that only read conversations (`prepare`, `regenerate`): `resolve_data_format`'s
    checks, the result unused."""
    resolve_data_format(data_format, tokenizer, target_name)


# ---------------------------------------------------------------------------------------------
# Reading documents


def _joined(conv: Conversation) -> Document:
    return Document(conv.id, "\n\n".join(m["content"] for m in conv.messages))


def _row_document(row, source: str, line: int) -> Document:
    """A `{"text", "id"?}` row, or a conversation row (joined)."""
    if isinstance(row, dict) and "text" in row:
        if not isinstance(row["text"], str):
            raise DataError(source, line, "text", f"expected a string, got {json_type_name(row['text'])}",
                            "non_string_content")
        row_id = row.get("id")
        return Document(str(row_id) if row_id is not None else content_id(line, row["text"]), row["text"])
    if isinstance(row, dict) and not {"conversations", "messages"} & set(row):
        raise DataError(source, line, "text", "missing (expected 'text', or a conversation)", "missing_field")
    return _joined(parse_row(row, source, line))


def _paragraphs(path: Path) -> list[Document]:
    parts = [p.strip() for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8"))]
    return [Document(content_id(i, p), p) for i, p in enumerate(parts) if p]  # not the name: a renamed file is the same


def read_documents(spec: str, skip_bad_rows: bool = False, max_samples: int | None = None,
                   seed: int = 0) -> tuple[list[Document], BadRows]:
    """Documents from `spec` (see the module doc); bad rows raise `DataError` with their location, or
    are counted with `skip_bad_rows`."""
    path = Path(spec).expanduser()
    if spec in CORPUS_SOURCES:
        convs, bad = read_conversations(spec, skip_bad_rows, max_samples, seed)
        return [_joined(c) for c in convs], bad
    if path.suffix == ".txt" and path.is_file():
        return _paragraphs(path)[:max_samples], BadRows()
    rows = file_rows(spec)
    docs, bad = [], BadRows()
    for line, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            docs.append(_row_document(row, path.name, line))
        except DataError as err:
            if not skip_bad_rows:
                raise
            bad.add(err.reason, str(err))
        if max_samples and len(docs) >= max_samples:
            break
    return docs, bad


# ---------------------------------------------------------------------------------------------
# Prompts, continuations, samples


def split_point(num_tokens: int, prompt_tokens: int) -> int:
    """Prompt length: `prompt_tokens`, at most half the document, at least one token."""
    return max(1, min(prompt_tokens, num_tokens // 2))


def encode_documents(tokenizer, docs: list[Document], cfg: DataConfig,
                     bad: BadRows) -> list[tuple[str, list[int], list[int]]]:
    """Per usable document (id, prompt ids, the document's continuation ids); too short or too long
    ones are counted in `bad`."""
    out = []
    for doc in docs:
        ids = list(tokenizer(doc.text, add_special_tokens=True)["input_ids"])
        if len(ids) < 2:
            bad.add("too_short", f"{doc.id}: {len(ids)} tokens, a prompt and a continuation need 2")
            continue
        cut = split_point(len(ids), cfg.text_prompt_tokens)
        if cut > cfg.max_len - 2:
            bad.add("too_long", f"{doc.id}: a {cut}-token prompt leaves no room in max_len {cfg.max_len}")
            continue
        out.append((doc.id, ids[:cut], ids[cut:]))
    return out


def _greedy_continuations(target, prompts: list[list[int]], cfg: DataConfig, seed: int, log,
                          heartbeat=None) -> list[list[int]]:
    """The target's greedy continuation of each prompt (up to its end-of-text token), in input order."""
    stop_ids = end_of_turn_ids(target)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # little padding per batch
    out: list[list[int]] = [[] for _ in prompts]
    t0, new_tokens = time.perf_counter(), 0
    for b in range(0, len(order), cfg.regen_batch_size):
        rows = order[b:b + cfg.regen_batch_size]
        for i, (tokens, _) in zip(rows, generate_batch(target, [prompts[i] for i in rows], cfg.regen_max_new_tokens,
                                                  0.0, stop_ids, seed)):
            out[i] = tokens
            new_tokens += len(tokens)
        if heartbeat is not None:
            heartbeat(f"text continuations batch {b // cfg.regen_batch_size}")
    log(f"data: the target continued {len(prompts)} text prompts, {new_tokens} tokens in "
        f"{time.perf_counter() - t0:.0f}s")
    return out


def continuation_samples(cfg: DataConfig, target, seed: int, log=print, heartbeat=None) -> list[TokenizedSample]:
    """Tokenized text-format samples (loss on the continuation only) for the tokenized-sample cache."""
    docs, bad = read_documents(cfg.train, cfg.skip_bad_rows, cfg.max_samples, seed)
    log(f"data: {len(docs)} text documents from {cfg.train}; {bad.summary()}")
    split = encode_documents(target.tokenizer, docs, cfg, bad)
    continuations = [c for _, _, c in split]
    if cfg.regenerate:
        continuations = _greedy_continuations(target, [p for _, p, _ in split], cfg, seed, log, heartbeat)
    samples = []
    for (doc_id, prompt, _), continuation in zip(split, continuations):
        ids = (prompt + continuation)[:cfg.max_len]
        mask = ([0] * len(prompt) + [1] * len(continuation))[:cfg.max_len]
        if sum(mask) < cfg.min_loss_tokens:
            bad.add("too_few_loss_tokens", f"{doc_id}: {sum(mask)} supervised tokens < {cfg.min_loss_tokens}")
            continue
        samples.append(TokenizedSample(doc_id, ids, mask))
    log(f"data: {len(samples)} text samples (prompt {cfg.text_prompt_tokens} tokens at most); {bad.summary()}")
    return samples


def continuations_with_taps(cfg: DataConfig, target, layer_ids: list[int], seed: int, log=print, heartbeat=None,
                            final_hidden: bool = False):
    """Regenerate + tap in one pass for the text format: `(TappedSamples, report)` as
    `regen_taps.regenerate_with_taps` gives for conversations (`final_hidden`: the same too)."""
    docs, bad = read_documents(cfg.train, cfg.skip_bad_rows, cfg.max_samples, seed)
    split = encode_documents(target.tokenizer, docs, cfg, bad)
    log(f"data: {len(docs)} text documents from {cfg.train}, {len(split)} with a prompt; {bad.summary()}")
    return regenerate_prompts_with_taps(target, [(doc_id, prompt) for doc_id, prompt, _ in split], layer_ids,
                                        cfg.regen_max_new_tokens, cfg.regen_batch_size, cfg.max_len,
                                        cfg.min_loss_tokens, heartbeat=heartbeat, final_hidden=final_hidden)
