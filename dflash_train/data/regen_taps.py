"""Regenerate responses and tap the target in the same pass.

Generating a response already runs the target over every prompt and response position; keeping
the hidden states of the tapped layers on the way gives the training taps for free, where a
separate tap pass would prefill every sample again (on the 2-core CPU, that pass costs as much
as the drafter training itself). The sample is built from the generated token ids themselves
(prompt ids + response ids up to and including the end-of-turn token), so taps, ids and the
loss mask line up exactly; nothing is decoded and re-tokenized.

Taps come from incremental decoding with a KV cache, as at inference (`eval/spec_decode.py`).
The last response token is never fed back, so its tap is zero: no training query sees it (context
is strictly before an anchor, and an anchor needs a supervised token after it).

The result is cached in one safetensors file (written atomically), keyed by its inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dflash_train.train.batching import Sample


@dataclass
class TappedSamples:
    samples: list[Sample]
    taps: list[torch.Tensor]  # per sample [len, K*H], storage dtype

    def save(self, path) -> None:
        from safetensors.torch import save_file

        from dflash_train import atomic

        lengths = torch.tensor([len(s) for s in self.samples])
        tensors = {"lengths": lengths,
                   "input_ids": torch.tensor([t for s in self.samples for t in s.input_ids], dtype=torch.int32),
                   "loss_mask": torch.tensor([m for s in self.samples for m in s.loss_mask], dtype=torch.uint8),
                   "taps": torch.cat(self.taps).contiguous()}
        atomic.write_with(path, lambda tmp: save_file(tensors, str(tmp),
                                                      metadata={"ids": "\n".join(s.id for s in self.samples)}))

    @classmethod
    def load(cls, path) -> "TappedSamples":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            ids = f.metadata()["ids"].split("\n")
            lengths = f.get_tensor("lengths").tolist()
            input_ids, loss_mask, taps = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "taps"))
        samples, tap_list, start = [], [], 0
        for sid, n in zip(ids, lengths):
            samples.append(Sample(sid, tuple(input_ids[start:start + n].tolist()),
                                  tuple(loss_mask[start:start + n].tolist())))
            tap_list.append(taps[start:start + n])
            start += n
        return cls(samples, tap_list)


def has_recurrent_layers(config) -> bool:
    """Hybrid targets (Qwen3-Next / Qwen3.5 style): some layers carry a recurrent state, not a KV cache."""
    text = getattr(config, "text_config", None) or config
    return "linear_attention" in (getattr(text, "layer_types", None) or ())


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


@torch.no_grad()
def _generate_batch(target, prompts: list[list[int]], layer_ids: list[int], max_new_tokens: int,
                    stop_ids: list[int], storage_dtype: torch.dtype) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """Greedy responses of one batch; per row (input_ids, loss_mask, taps [len, K*H]).

    A row that has produced its end-of-turn token leaves the batch and the KV cache at once
    (`DynamicCache.batch_select_indices`): on a CPU the cost of a decode step grows with the rows
    in it, and chat replies differ in length by 5x, so finished rows would waste most of the work.
    Hybrid targets (linear-attention layers) keep finished rows in the batch, their outputs ignored:
    transformers' batch selection does not cover their recurrent states, and their cache is the
    model's own (config-aware) one.
    """
    from dflash_train.eval.spec_decode import _cache_kwarg, new_cache

    model = target.model
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stop_ids[0]
    ids, mask = _left_pad(prompts, pad)
    ids, mask = ids.to(target.device), mask.to(target.device)
    cache_arg, recurrent = _cache_kwarg(type(model)), has_recurrent_layers(model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                use_cache=True, output_hidden_states=True, logits_to_keep=1,
                **({} if recurrent else {cache_arg: new_cache()}))
    cache = getattr(out, cache_arg)
    width = ids.shape[1]
    prompt_taps = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # [b, P, K*H]
    responses = [[] for _ in prompts]
    fed_taps = [[] for _ in prompts]  # hidden state of each response token once it is fed back
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
        step_taps = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[:, 0]  # [b', K*H]
        for j, row in enumerate(active):
            if row not in finished:
                fed_taps[row].append(step_taps[j].to(storage_dtype))
        next_tok, positions = out.logits[:, -1].argmax(-1), positions + 1
    rows = []
    for r, prompt in enumerate(prompts):
        response = responses[r]
        # taps: prompt positions, then response tokens 0..n-2 (token k's hidden state is computed when
        # it is fed back); the last response token is never fed back, so its tap stays zero.
        taps = torch.zeros(len(prompt) + len(response), prompt_taps.shape[-1], dtype=storage_dtype)
        taps[:len(prompt)] = prompt_taps[r, width - len(prompt):].to(storage_dtype)
        if fed_taps[r]:
            taps[len(prompt):len(prompt) + len(fed_taps[r])] = torch.stack(fed_taps[r])
        rows.append((prompt + response, [0] * len(prompt) + [1] * len(response), taps))
    return rows


def regenerate_with_taps(target, conversations, layer_ids: list[int], max_new_tokens: int, batch_size: int,
                         max_len: int, thinking: bool | None = None, min_loss_tokens: int = 2,
                         storage_dtype: torch.dtype = torch.bfloat16, heartbeat=None) -> tuple[TappedSamples, dict]:
    """Greedy target responses for every conversation's last user turn, with their taps."""
    from dflash_train.data.conversations import render_chat
    from dflash_train.data.regenerate import prompt_messages

    encoded = []
    for conv in conversations:
        text = render_chat(target.tokenizer, prompt_messages(conv.messages), add_generation_prompt=True,
                           thinking=thinking)
        encoded.append((conv.id, target.tokenizer(text, add_special_tokens=False)["input_ids"]))
    return regenerate_prompts_with_taps(target, encoded, layer_ids, max_new_tokens, batch_size, max_len,
                                        min_loss_tokens, storage_dtype, heartbeat)


def regenerate_prompts_with_taps(target, encoded: list[tuple[str, list[int]]], layer_ids: list[int],
                                 max_new_tokens: int, batch_size: int, max_len: int, min_loss_tokens: int = 2,
                                 storage_dtype: torch.dtype = torch.bfloat16,
                                 heartbeat=None) -> tuple[TappedSamples, dict]:
    """Greedy target continuations of token-id prompts `(id, ids)`, with their taps (the chat and the
    plain-text formats share this)."""
    from dflash_train.data.regenerate import end_of_turn_ids

    stop_ids = end_of_turn_ids(target)
    encoded = sorted(encoded, key=lambda e: -len(e[1]))  # little padding per batch; an OOM shows at once
    samples, taps, skipped, new_tokens = [], [], {"too_long": 0, "too_few_loss_tokens": 0}, 0
    start = time.perf_counter()
    bar = tqdm(total=len(encoded), unit="prompt", desc="regenerate+tap", dynamic_ncols=True)
    for b in range(0, len(encoded), batch_size):
        batch = [e for e in encoded[b:b + batch_size] if len(e[1]) < max_len - 2]
        skipped["too_long"] += len(encoded[b:b + batch_size]) - len(batch)
        with torch.no_grad():
            rows = _generate_batch(target, [e[1] for e in batch], layer_ids, max_new_tokens, stop_ids,
                                   storage_dtype) if batch else []
        for (cid, _), (ids, mask, row_taps) in zip(batch, rows):
            new_tokens += sum(mask)
            ids, mask, row_taps = ids[:max_len], mask[:max_len], row_taps[:max_len]
            if sum(mask) < min_loss_tokens:
                skipped["too_few_loss_tokens"] += 1
                continue
            samples.append(Sample(cid, tuple(ids), tuple(mask)))
            taps.append(row_taps)
        bar.update(len(encoded[b:b + batch_size]))
        bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - start, 1e-9):.0f}")
        if heartbeat is not None:
            heartbeat(f"regenerate+tap batch {b // batch_size}")
    bar.close()
    report = {"samples": len(samples), "new_tokens": new_tokens, "seconds": time.perf_counter() - start,
              "skipped": skipped}
    return TappedSamples(samples, taps), report
