"""Regenerate responses and tap the target in the same pass.

Generating a response already runs the target over every prompt and response position; keeping
the hidden states of the tapped layers on the way gives the training taps for free, where a
separate tap pass would prefill every sample again (on the 2-core CPU, that pass costs as much
as the drafter training itself). The sample is built from the generated token ids themselves
(prompt ids + response ids up to and including the end-of-turn token), so taps, ids and the
loss mask line up exactly; nothing is decoded and re-tokenized.

Taps come from incremental decoding with a KV cache, as at inference (`eval/spec_decode.py`), and
are indexed as everywhere (`model/target/taps.py`).
The last response token is never fed back, so its tap is zero: no training query sees it (context
is strictly before an anchor, and an anchor needs a supervised token after it).

With `final_hidden` (a distillation loss: loss.kind != ce) the target's last hidden state after
its final norm is kept the same way, per position, as the entry "final_hidden" of the file.

The result is cached in one safetensors file (written atomically), keyed by its inputs (the file
name says whether it holds "final_hidden": `data/dataset.py prepare_tapped`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm

from dflash_train import atomic
from dflash_train.data import graph_decode
from dflash_train.data.conversations import prompt_messages, render_chat
from dflash_train.data.records import Sample
from dflash_train.data.regenerate import end_of_turn_ids, pad_id
from dflash_train.model.target.decoding import cache_kwarg, left_pad, mask_positions, new_cache
from dflash_train.model.target.taps import select_taps


FINAL_HIDDEN = "final_hidden"  # as in train/feed/taps.py (the data layer does not import the trainer)


@dataclass
class TappedSamples:
    samples: list[Sample]
    taps: list[torch.Tensor]  # per sample [len, K*H], storage dtype
    final_hidden: list[torch.Tensor] | None = None  # per sample [len, H] after the final norm, when stored
    flat: dict[str, torch.Tensor] | None = None  # loaded: the file's [T, width] tensors the rows are views of

    def packed(self) -> dict[str, torch.Tensor]:
        """{name: [T, width]}: every sample's rows end to end, in sample order (the loaded file's own tensors,
        no copy)."""
        if self.flat is not None:
            return self.flat
        out = {"taps": torch.cat(self.taps)}
        if self.final_hidden is not None:
            out[FINAL_HIDDEN] = torch.cat(self.final_hidden)
        return out

    def rows(self) -> list[dict[str, torch.Tensor]]:
        """Per sample {name: [len, width]}: what the trainer's StoredRows reads."""
        rows = [{"taps": t} for t in self.taps]
        for row, hidden in zip(rows, self.final_hidden or []):
            row[FINAL_HIDDEN] = hidden
        return rows

    def save(self, path, durable: bool = True) -> None:
        """One safetensors file; the rows are written sample by sample (`write_safetensors`), never concatenated in
        memory (15.5 GB for the `gpu` recipe)."""
        tensors = {"lengths": torch.tensor([len(s) for s in self.samples]),
                   "input_ids": torch.tensor([t for s in self.samples for t in s.input_ids], dtype=torch.int32),
                   "loss_mask": torch.tensor([m for s in self.samples for m in s.loss_mask], dtype=torch.uint8),
                   "taps": self.taps}
        if self.final_hidden is not None:
            tensors[FINAL_HIDDEN] = self.final_hidden
        metadata = {"ids": "\n".join(s.id for s in self.samples)}
        atomic.write_with(path, lambda tmp: write_safetensors(tmp, tensors, metadata), durable)

    @classmethod
    def load(cls, path) -> "TappedSamples":
        """The taps are memory-mapped, not read: several runs on one machine (A/B arms, ranks) share
        the page cache's one copy instead of holding one each (15 GB for the `gpu` recipe's data)."""
        with safe_open(str(path), "pt") as f:
            ids = f.metadata()["ids"].split("\n")
            lengths = f.get_tensor("lengths").tolist()
            input_ids, loss_mask = (f.get_tensor(k) for k in ("input_ids", "loss_mask"))
            names = set(f.keys())
        mapped = mapped_safetensors(path, [k for k in ("taps", FINAL_HIDDEN) if k in names])
        taps, final = mapped["taps"], mapped.get(FINAL_HIDDEN)
        samples, tap_list, final_list, start = [], [], [], 0
        for sid, n in zip(ids, lengths):
            samples.append(Sample(sid, tuple(input_ids[start:start + n].tolist()),
                                  tuple(loss_mask[start:start + n].tolist())))
            tap_list.append(taps[start:start + n])
            if final is not None:
                final_list.append(final[start:start + n])
            start += n
        return cls(samples, tap_list, final_list if final is not None else None, mapped)


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def write_safetensors(path, tensors: dict[str, "torch.Tensor | list[torch.Tensor]"], metadata: dict[str, str]) -> None:
    """A safetensors file of `tensors`, where a list stands for its pieces concatenated along dim 0 (written one
    after the other, never joined in memory). Readable by safetensors itself (tests)."""
    pieces = {name: t if isinstance(t, list) else [t] for name, t in tensors.items()}
    header, offset = {"__metadata__": metadata}, 0
    for name, parts in pieces.items():
        rows = sum(p.shape[0] for p in parts)
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        header[name] = {"dtype": SAFETENSORS_NAMES[parts[0].dtype], "shape": [rows, *parts[0].shape[1:]],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for parts in pieces.values():
            for part in parts:
                if part.numel():
                    f.write(memoryview(part.contiguous().view(-1).view(torch.uint8).numpy()))


def mapped_safetensors(path, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors `names` of a safetensors file as read-only-in-spirit views of one private memory map
    (copy-on-write: untouched pages stay the page cache's, shared by every process mapping the file)."""
    path = str(path)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=os.path.getsize(path))
    out = {}
    for name in names:
        entry = header[name]
        begin, end = (8 + header_len + o for o in entry["data_offsets"])
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        out[name] = torch.empty(0, dtype=dtype).set_(storage[begin:end]).view(entry["shape"])
    return out


def has_recurrent_layers(config) -> bool:
    """Hybrid targets (Qwen3-Next / Qwen3.5 style): some layers carry a recurrent state, not a KV cache."""
    text = getattr(config, "text_config", None) or config
    return "linear_attention" in (getattr(text, "layer_types", None) or ())


def _position_tensors(hidden_states, layer_ids: list[int], final_hidden: bool) -> dict[str, torch.Tensor]:
    """{"taps": [b, P, K*H], "final_hidden": [b, P, H]} of one forward's `hidden_states`; HF's
    last entry is after the final norm (Llama, Qwen3, ...; tests/data/test_regen_taps.py)."""
    out = {"taps": select_taps(hidden_states, layer_ids)}
    if final_hidden:
        out[FINAL_HIDDEN] = hidden_states[-1]
    return out


@torch.no_grad()
def _generate_batch(target, prompts: list[list[int]], layer_ids: list[int], max_new_tokens: int,
                    stop_ids: list[int], storage_dtype: torch.dtype, final_hidden: bool = False
                    ) -> list[tuple[list[int], list[int], dict[str, torch.Tensor]]]:
    """Greedy responses of one batch; per row (input_ids, loss_mask, {"taps" [len, K*H],
    "final_hidden" [len, H] when asked}).

    A row that has produced its end-of-turn token leaves the batch and the KV cache at once
    (`DynamicCache.batch_select_indices`): on a CPU the cost of a decode step grows with the rows
    in it, and chat replies differ in length by 5x, so finished rows would waste most of the work.
    Hybrid targets (linear-attention layers) keep finished rows in the batch, their outputs ignored:
    transformers' batch selection does not cover their recurrent states, and their cache is the
    model's own (config-aware) one.
    """
    model = target.model
    pad = pad_id(target, stop_ids)
    ids, mask = (t.to(target.device) for t in left_pad(prompts, pad))
    cache_arg, recurrent = cache_kwarg(type(model)), has_recurrent_layers(model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=mask_positions(mask),
                use_cache=True, output_hidden_states=True, logits_to_keep=1,
                **({} if recurrent else {cache_arg: new_cache()}))  # hybrid: the model's own cache
    cache = getattr(out, cache_arg)
    width = ids.shape[1]
    prompt_tensors = _position_tensors(out.hidden_states, layer_ids, final_hidden)  # name -> [b, P, width]
    responses = [[] for _ in prompts]
    fed = _FedPositions()  # what each response token's forward produced, gathered per row at the end
    active = list(range(len(prompts)))
    next_tok = out.logits[:, -1].argmax(-1)  # [b]
    positions = mask.sum(-1)  # next position of each active row
    finished = set()  # rows done but still in the batch (hybrid targets only)
    for _ in range(max_new_tokens):
        keep = []
        for j, (row, token) in enumerate(zip(active, next_tok.tolist())):
            if row in finished:
                continue
            responses[row].append(token)
            if token not in stop_ids and len(responses[row]) < max_new_tokens:
                keep.append(j)
            else:
                finished.add(row)
        if not keep:
            break
        if len(keep) < len(active) and not recurrent:
            index = torch.tensor(keep, device=ids.device)
            cache.batch_select_indices(index)
            mask, next_tok, positions = mask[index], next_tok[index], positions[index]
            active = [active[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        out = model(input_ids=next_tok[:, None], attention_mask=mask, position_ids=positions[:, None],
                    use_cache=True, output_hidden_states=True, **{cache_arg: cache})
        fed.add([row if row not in finished else -1 for row in active],
                _position_tensors(out.hidden_states, layer_ids, final_hidden))  # name -> [b', 1, width]
        next_tok, positions = out.logits[:, -1].argmax(-1), positions + 1
    per_row = fed.per_row(len(prompts), storage_dtype)  # name -> list of [n_r, width] on the CPU
    prompt_tensors = {n: t.to("cpu", storage_dtype) for n, t in prompt_tensors.items()}
    return [_row(prompt, responses[r], width, {n: t[r] for n, t in prompt_tensors.items()},
                 {n: rows[r] for n, rows in per_row.items()}, storage_dtype)
            for r, prompt in enumerate(prompts)]


def _batch_generator(target, encoded, layer_ids, max_new_tokens, batch_size, max_len, stop_ids, storage_dtype,
                     final_hidden, graph: bool | None):
    """prompts -> rows of `_generate_batch`, by the dynamic loop or the fixed-shape one."""
    if graph is None:
        graph = target.device.type == "cuda" and graph_decode.supports(target.model)
    if not graph:
        return lambda prompts: _generate_batch(target, prompts, layer_ids, max_new_tokens, stop_ids, storage_dtype,
                                               final_hidden)
    pad = pad_id(target, stop_ids)
    decoder = graph_decode.GraphDecoder(
        target.model, lambda hidden: _position_tensors(hidden, layer_ids, final_hidden),
        min(batch_size, len(encoded)), stop_ids, pad, use_graph=target.device.type == "cuda")

    def generate(prompts):
        responses, packed = decoder.decode(prompts, max_new_tokens, storage_dtype)
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        rows = {name: torch.split(t, lengths) for name, t in packed.items()}  # views of the batch's one tensor
        return [(prompt + response, [0] * len(prompt) + [1] * len(response), {n: rows[n][i] for n in rows})
                for i, (prompt, response) in enumerate(zip(prompts, responses))]
    return generate


class _FedPositions:
    """The hidden states of the response tokens fed back, kept as whole decode steps ([b', 1, D] per
    name, with the batch row of each of the b' entries; -1 for a finished row of a hybrid target)
    and gathered per row once at the end: a per-row slice at every step costs 2 x batch tensor
    operations per step, which at batch 1024 on a GPU took longer than the forward itself."""

    def __init__(self):
        self.rows: list[list[int]] = []
        self.steps: list[dict[str, torch.Tensor]] = []

    def add(self, rows: list[int], step: dict[str, torch.Tensor]) -> None:
        self.rows.append(rows)
        self.steps.append(step)

    def per_row(self, batch: int, dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
        """name -> per batch row, its fed positions in order: [n_r, D] on the CPU."""
        if not self.steps:
            return {}
        owner = torch.tensor([r for rows in self.rows for r in rows])  # [total]: step-major order
        order = torch.sort(owner, stable=True).indices  # row-major, steps in order within a row
        counts = torch.bincount(owner[owner >= 0], minlength=batch).tolist()
        skip = int((owner < 0).sum())  # finished hybrid rows sort first: dropped
        out = {}
        for name in self.steps[0]:
            flat = torch.cat([step[name][:, 0] for step in self.steps])  # [total, D]
            flat = flat[order.to(flat.device)][skip:].to("cpu", dtype)
            out[name] = list(torch.split(flat, counts))
        return out


def _row(prompt: list[int], response: list[int], width: int, prompt_tensors: dict, fed: dict,
         storage_dtype: torch.dtype) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """One sample: prompt positions (left-padded in `prompt_tensors`: [width, D]), then response
    tokens 0..n-2 (token k's hidden state is computed when it is fed back: `fed[name]` [n-1, D]);
    the last response token is never fed back, so its row stays zero."""
    tensors = {}
    for name, t in prompt_tensors.items():
        out = torch.zeros(len(prompt) + len(response), t.shape[-1], dtype=storage_dtype)
        out[:len(prompt)] = t[width - len(prompt):]
        done = fed.get(name)
        if done is not None and len(done):
            out[len(prompt):len(prompt) + len(done)] = done
        tensors[name] = out
    return prompt + response, [0] * len(prompt) + [1] * len(response), tensors


def regenerate_with_taps(target, conversations, layer_ids: list[int], max_new_tokens: int, batch_size: int,
                         max_len: int, thinking: bool | None = None, min_loss_tokens: int = 2,
                         storage_dtype: torch.dtype = torch.bfloat16, heartbeat=None,
                         final_hidden: bool = False, graph: bool | None = None) -> tuple[TappedSamples, dict]:
    """Greedy target responses for every conversation's last user turn, with their taps (and the
    final hidden states, for a distillation loss, when `final_hidden`)."""
    texts = [render_chat(target.tokenizer, prompt_messages(conv.messages), add_generation_prompt=True,
                         thinking=thinking) for conv in conversations]
    # one call: a fast tokenizer encodes a list on all cores (6,000 chit-chat prompts: 4.8 -> 2.4 s on 2 cores)
    ids = target.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    encoded = [(conv.id, row) for conv, row in zip(conversations, ids)]
    return regenerate_prompts_with_taps(target, encoded, layer_ids, max_new_tokens, batch_size, max_len,
                                        min_loss_tokens, storage_dtype, heartbeat, final_hidden, graph)


def regenerate_prompts_with_taps(target, encoded: list[tuple[str, list[int]]], layer_ids: list[int],
                                 max_new_tokens: int, batch_size: int, max_len: int, min_loss_tokens: int = 2,
                                 storage_dtype: torch.dtype = torch.bfloat16, heartbeat=None,
                                 final_hidden: bool = False, graph: bool | None = None) -> tuple[TappedSamples, dict]:
    """Greedy target continuations of token-id prompts `(id, ids)`, with their taps (and final hidden
    states when `final_hidden`); the chat and the plain-text formats share this. `graph`: decode at a
    fixed shape (`data/graph_decode.py`; None: where it pays, a CUDA device and a target it supports)."""
    stop_ids = end_of_turn_ids(target)
    encoded = sorted(encoded, key=lambda e: -len(e[1]))  # little padding per batch; an OOM shows at once
    samples, kept, skipped, new_tokens = [], [], {"too_long": 0, "too_few_loss_tokens": 0}, 0
    generate = _batch_generator(target, encoded, layer_ids, max_new_tokens, batch_size, max_len, stop_ids,
                                storage_dtype, final_hidden, graph)
    start = time.perf_counter()
    bar = tqdm(total=len(encoded), unit="prompt", desc="regenerate+tap", dynamic_ncols=True)
    for b in range(0, len(encoded), batch_size):
        batch = [e for e in encoded[b:b + batch_size] if len(e[1]) < max_len - 2]
        skipped["too_long"] += len(encoded[b:b + batch_size]) - len(batch)
        with torch.no_grad():
            rows = generate([e[1] for e in batch]) if batch else []
        for (cid, _), (ids, mask, tensors) in zip(batch, rows):
            new_tokens += sum(mask)
            ids, mask = ids[:max_len], mask[:max_len]
            if sum(mask) < min_loss_tokens:
                skipped["too_few_loss_tokens"] += 1
                continue
            samples.append(Sample(cid, tuple(ids), tuple(mask)))
            kept.append({name: t[:max_len] for name, t in tensors.items()})
        bar.update(len(encoded[b:b + batch_size]))
        bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - start, 1e-9):.0f}")
        if heartbeat is not None:
            heartbeat(f"regenerate+tap batch {b // batch_size}")
    bar.close()
    report = {"samples": len(samples), "new_tokens": new_tokens, "seconds": time.perf_counter() - start,
              "skipped": skipped}
    finals = [row[FINAL_HIDDEN] for row in kept] if final_hidden else None
    return TappedSamples(samples, [row["taps"] for row in kept], finals), report
