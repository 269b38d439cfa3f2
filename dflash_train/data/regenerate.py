"""Regenerate assistant responses with the target (spec 2.7: the largest lever on acceptance).

For each conversation the prompt is everything up to its last user turn; the target writes the
reply (greedy by default), and one JSONL row `{"id", "messages": [..., {"role": "assistant",
"content": reply}], "finish_reason", "new_tokens"}` is appended per conversation. The file is
flushed and fsync'd after every batch, and a restart skips ids already present (a torn last line
from a crash is truncated away), so an interrupted run resumes with no duplicate and no gap.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from dflash_train.data.conversations import prompt_messages, render_chat
from dflash_train.data.records import Conversation
from dflash_train.model.target.decoding import left_pad

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>", "<|end|>", "</s>")


@dataclass
class RegenReport:
    total: int
    already_done: int
    written: int = 0
    new_tokens: int = 0
    truncated: int = 0
    """Rows that hit `max_new_tokens` before an end-of-turn token."""
    seconds: float = 0.0


def read_done_ids(out_path: Path) -> set[str]:
    """Ids already written. A torn last line (no trailing newline: the writer died mid-line) is
    truncated away so the next append starts on a clean line; a bad complete line is an error."""
    if not out_path.exists():
        return set()
    data = out_path.read_bytes()
    keep = data.rfind(b"\n") + 1  # bytes up to the last complete line
    if keep < len(data):
        print(f"regenerate: {out_path.name}: truncating a torn last line ({len(data) - keep} bytes)", flush=True)
        with open(out_path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    done = set()
    for line_no, line in enumerate(data[:keep].splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{out_path}:{line_no}: not a regenerated row ({e}); refusing to append") from e
    return done


def end_of_turn_ids(target) -> list[int]:
    """eos plus the end-of-turn tokens the tokenizer knows (generation stops at any of them)."""
    tok = target.tokenizer
    ids = set()
    gen_eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    for value in (tok.eos_token_id, gen_eos):
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(int(i) for i in ids)


def pad_id(target, stop_ids: list[int]) -> int:
    """The id left padding uses: the tokenizer's pad token, else the first stop token (masked anyway)."""
    return target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stop_ids[0]


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], max_new_tokens: int, temperature: float,
              stop_ids: list[int], seed: int) -> list[tuple[list[int], bool]]:
    """Batched generation; returns per row (new tokens before the stop token, stopped?)."""
    pad = pad_id(target, stop_ids)
    ids, mask = (t.to(target.device) for t in left_pad(prompts, pad))
    sample = temperature > 0
    kwargs = dict(do_sample=sample, max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad)
    if sample:
        kwargs.update(temperature=temperature, top_k=None, top_p=None)
    devices = [target.device] if target.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # seeded, without disturbing the caller's RNG
        torch.manual_seed(seed)
        out = target.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    results = []
    for row in out[:, ids.shape[1]:].tolist():
        stop = next((i for i, t in enumerate(row) if t in stop_ids), None)
        results.append((row if stop is None else row[:stop], stop is not None))
    return results


def _append_rows(out_path: Path, rows: list[dict]) -> None:
    with open(out_path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def _check_unique_ids(conversations: list[Conversation]) -> None:
    seen, dups = set(), set()
    for c in conversations:
        (dups if c.id in seen else seen).add(c.id)
    if dups:
        raise ValueError(f"duplicate conversation ids (resume needs unique ids): {sorted(dups)[:5]}")


def regenerate(target, conversations: list[Conversation], out_path: str | Path, max_new_tokens: int,
               batch_size: int, temperature: float = 0.0, thinking: bool | None = None, seed: int = 0,
               on_batch: Callable[[int], None] | None = None, done: set[str] | None = None,
               write: bool = True) -> RegenReport:
    """Write target responses for every conversation not yet in `out_path` (see module doc).

    Prompts are sorted by length (longest first: little padding, and an OOM shows at once).
    `on_batch(batch_index)` runs after each batch is durably written. `done` overrides the ids read
    from `out_path`; `write=False` runs the same generation without writing (a target group's other
    ranks, whose sharded forwards the writing rank needs).
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _check_unique_ids(conversations)
    done = read_done_ids(out_path) if done is None else done
    todo = [c for c in conversations if c.id not in done]
    report = RegenReport(total=len(conversations), already_done=len(conversations) - len(todo))
    print(f"regenerate: {len(todo)} to generate, {report.already_done} already in {out_path}", flush=True)
    encoded = []
    for conv in todo:
        prompt = prompt_messages(conv.messages)
        text = render_chat(target.tokenizer, prompt, add_generation_prompt=True, thinking=thinking)
        encoded.append((conv.id, prompt, target.tokenizer(text, add_special_tokens=False)["input_ids"]))
    encoded.sort(key=lambda e: -len(e[2]))
    stop_ids = end_of_turn_ids(target)
    t0 = time.perf_counter()
    bar = tqdm(total=len(encoded), unit="prompt", desc="regenerate", dynamic_ncols=True)
    for b, start in enumerate(range(0, len(encoded), batch_size)):
        batch = encoded[start:start + batch_size]
        outs = generate_batch(target, [e[2] for e in batch], max_new_tokens, temperature, stop_ids,
                         seed * 1_000_003 + b)
        rows = []
        for (cid, prompt, _), (tokens, stopped) in zip(batch, outs):
            reply = target.tokenizer.decode(tokens, skip_special_tokens=True)
            rows.append({"id": cid, "messages": prompt + [{"role": "assistant", "content": reply}],
                         "finish_reason": "stop" if stopped else "length", "new_tokens": len(tokens)})
            report.new_tokens += len(tokens)
            report.truncated += not stopped
        if write:
            _append_rows(out_path, rows)
        report.written += len(rows)
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{report.new_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
        if on_batch is not None:
            on_batch(b)
    bar.close()
    report.seconds = time.perf_counter() - t0
    return report


def group_part(out_path: str | Path, group: int) -> Path:
    """Where target group `group` of a grouped `regenerate` appends its share (resumable like `out_path`)."""
    out_path = Path(out_path)
    return out_path.with_name(f"{out_path.stem}.group-{group:05d}{out_path.suffix or '.jsonl'}")


def merge_parts(out_path: str | Path, parts: list[Path]) -> int:
    """Rewrite `out_path` atomically as its own rows followed by the parts' rows it lacks (in part
    order); returns the rows added. Re-running it changes nothing: the parts stay as resume state."""
    from dflash_train import atomic

    out_path = Path(out_path)
    lines = out_path.read_text(encoding="utf-8").splitlines() if out_path.exists() else []
    have = read_done_ids(out_path)
    added = []
    for part in parts:
        for line in part.read_text(encoding="utf-8").splitlines() if part.exists() else []:
            if line.strip() and (row_id := str(json.loads(line)["id"])) not in have:
                have.add(row_id)
                added.append(line)
    atomic.write_text(out_path, "".join(line + "\n" for line in lines + added))
    return len(added)
