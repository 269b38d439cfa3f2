"""Real speculative decoding with a DFlash drafter against an HF target (spec 1.6), and the plain
autoregressive baseline, both written as the same simple KV-cache loop so they are timed alike.

Conventions:
- Batch size 1. `prompt_ids` is [1, P]; the target's `DynamicCache` holds positions [0, start) and
  the drafter's `ContextCache` holds the taps of the same positions, so `start` is both caches'
  length and the position of the anchor (the last emitted, not yet verified token).
- Taps use z-lab semantics (`model/taps.py`): id i is HF `hidden_states[i + 1]`, concatenated
  over `layer_ids`.
- One step: draft block `[anchor, MASK x (B-1)]` at positions [start, start+B), embedded with the
  target's embedding; the drafter proposes slots 1..B-1; the target reads the B tokens in one
  forward; `acc` = number of accepted draft tokens (0..B-1); the step emits acc + 1 tokens (the
  accepted drafts plus the target's correction/bonus token), the target cache is cropped to
  start+acc+1 and the drafter cache gets the taps of positions start..start+acc.
- Greedy (temperature 0): acc = longest prefix with draft[k] == target_argmax[k-1], so the output
  equals plain greedy decoding token for token (up to floating-point ties).
- temperature > 0: standard speculative rejection sampling (accept x with prob min(1, p(x)/q(x)),
  on rejection sample norm(max(p - q, 0)), after full acceptance sample the bonus from p), so the
  output distribution equals the target's. DFlash drafts all slots independently given the
  context, which keeps the scheme exact (slot k's draw does not depend on slots < k).
- Stopping (shared by both loops): generation ends after the first token in `eos_ids` (kept in
  the output) or after `max_new_tokens` tokens; tokens a step produced past that are dropped.
- tau (acceptance length, the paper's definition) = tokens produced per verification forward =
  mean over steps of (acc + 1). The first token comes from the prefill and is no step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch
from transformers import DynamicCache

from dflash_train.model.decoding import cache_kwarg, new_cache
from dflash_train.model.drafter import ContextCache, DFlashDrafter
from dflash_train.model.taps import select_taps


@dataclass
class SpecResult:
    """One speculative generation: emitted ids and per-verification accepted counts."""

    tokens: list[int]
    """Generated ids (prompt excluded), after the stopping rule."""
    accepted: list[int]
    """Per verification forward: draft tokens accepted, 0..block_size-1 (the step emitted acc+1)."""
    block_size: int
    seconds: float
    """Wall time of prefill + all steps (device synchronised)."""
    stopped_by_eos: bool

    @property
    def tau(self) -> float:
        """Mean tokens per verification forward (accepted + 1); 0.0 when no step ran."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 0.0


@dataclass
class GenResult:
    """One plain autoregressive generation of the target."""

    tokens: list[int]
    seconds: float
    stopped_by_eos: bool


# ---------------------------------------------------------------------------------------------
# Small pieces


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax in float64: rejection sampling compares probabilities, keep them exact enough."""
    return torch.softmax(logits.double() / temperature, dim=-1)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of probs [n, V] -> [n]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy argmax or a temperature sample per row of logits [n, V] -> [n]."""
    if temperature <= 0:
        return logits.argmax(-1)
    return _sample(_probs(logits, temperature), generator)


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    """Apply the stopping rule: cut after the first eos (kept), then at max_new_tokens."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], False


def _done(tokens: list[int], new: int, max_new_tokens: int, eos: set[int]) -> bool:
    """True once max_new_tokens are out or one of the `new` last tokens is an eos."""
    return len(tokens) >= max_new_tokens or any(t in eos for t in tokens[len(tokens) - new:])


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Keep the first `keep` positions. A negative argument means "remove that many" both in
    transformers <= 5.17 (where a positive one is the new length) and later (where it is refused)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


@torch.no_grad()
def _target_forward(model, ids: torch.Tensor, cache: DynamicCache, hidden: bool, logits_to_keep: int = 0):
    """Target forward of ids [1, n] after the cached positions; returns (logits [1, n', V], hidden states)."""
    kwargs = {cache_kwarg(type(model)): cache}
    out = model(input_ids=ids, use_cache=True, output_hidden_states=hidden, logits_to_keep=logits_to_keep,
                **kwargs)
    return out.logits, out.hidden_states


# ---------------------------------------------------------------------------------------------
# Draft and verify


def _param(drafter: DFlashDrafter) -> torch.Tensor:
    """Any drafter parameter: its device and dtype are the drafter's (it may sit on another GPU)."""
    return next(drafter.parameters())


def _append_taps(ctx: ContextCache, drafter: DFlashDrafter, taps: torch.Tensor) -> None:
    p = _param(drafter)
    ctx.append(drafter, taps.to(p.device, p.dtype))


@torch.no_grad()
def draft_logits(drafter: DFlashDrafter, ctx: ContextCache, anchor: int, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, block_size: int) -> torch.Tensor:
    """Drafter logits [B-1, V] for slots 1..B-1 of the block [anchor, MASK x (B-1)] at ctx.length,
    on the lm_head's device."""
    start, p = ctx.length, _param(drafter)
    ids = torch.full((1, block_size), drafter.config.mask_token_id, dtype=torch.long, device=embed_weight.device)
    ids[0, 0] = anchor
    embeds = embed_weight[ids].to(p.device, p.dtype)  # [1, B, H]
    positions = torch.arange(start, start + block_size, device=p.device)[None]  # [1, B]
    hidden = drafter.draft(embeds, ctx, positions)  # [1, B, H], final-normed
    return hidden[0, 1:].to(lm_head_weight.device, lm_head_weight.dtype) @ lm_head_weight.T  # [B-1, V]


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft [B-1], target_logits [B, V] -> (acc, next token = target argmax after the accepted prefix)."""
    target_tokens = target_logits.argmax(-1)  # [B]; row k predicts the token after slot k
    acc = int((draft == target_tokens[:-1]).int().cumprod(0).sum())
    return acc, int(target_tokens[acc])


def accept_sampled(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling of one block.

    draft [B-1] drawn from q [B-1, V]; p [B, V] target probabilities, row k for the token after
    slot k. Returns (acc, next token): the correction from norm(max(p-q, 0)) at the first
    rejection, or the bonus from p[B-1] when every draft token is accepted.
    """
    n = draft.shape[0]
    rows = torch.arange(n, device=draft.device)
    p_x, q_x = p[rows, draft], q[rows, draft]  # [B-1]
    u = torch.rand(n, generator=generator, device=draft.device, dtype=p.dtype)
    accept = u * q_x < p_x  # u < p/q without dividing; q_x > 0 as x was drawn from q
    acc = int(accept.int().cumprod(0).sum())
    if acc == n:
        return acc, int(_sample(p[n:], generator))
    residual = (p[acc] - q[acc]).clamp(min=0)
    if residual.sum() <= 0:  # p == q exactly: rejection had probability 0, fall back to p
        residual = p[acc]
    return acc, int(_sample((residual / residual.sum())[None], generator))


def _spec_step(target_model, drafter: DFlashDrafter, cache: DynamicCache, ctx: ContextCache, anchor: int,
               embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, layer_ids, block_size: int,
               temperature: float, generator) -> tuple[int, list[int]]:
    """One draft + verify step; returns (acc, the acc + 1 emitted tokens)."""
    start, device = ctx.length, embed_weight.device
    assert cache.get_seq_length() == start, "target and drafter caches out of step"
    d_logits = draft_logits(drafter, ctx, anchor, embed_weight, lm_head_weight, block_size)
    q = _probs(d_logits, temperature) if temperature > 0 else None
    draft = d_logits.argmax(-1) if q is None else _sample(q, generator)  # [B-1]
    block = torch.cat([torch.tensor([anchor], device=device), draft.to(device)])[None]  # [1, B]
    t_logits, hidden = _target_forward(target_model, block, cache, hidden=True)  # [1, B, V]
    if q is None:
        acc, nxt = accept_greedy(draft, t_logits[0])
    else:
        acc, nxt = accept_sampled(draft, q, _probs(t_logits[0], temperature), generator)
    crop_cache(cache, start + acc + 1)  # keep the anchor and the accepted drafts
    _append_taps(ctx, drafter, select_taps(hidden, layer_ids)[:, : acc + 1])
    return acc, draft[:acc].tolist() + [nxt]


# ---------------------------------------------------------------------------------------------
# The two generation loops


@torch.no_grad()
def speculative_generate(target_model, drafter: DFlashDrafter, embed_weight: torch.Tensor,
                         lm_head_weight: torch.Tensor, layer_ids, prompt_ids: torch.Tensor, max_new_tokens: int,
                         eos_ids: Iterable[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None, block_size: int | None = None) -> SpecResult:
    """DFlash speculative decoding of one prompt [1, P] (see the module docstring for the rules)."""
    block_size = block_size or drafter.config.block_size
    eos, device = set(int(e) for e in eos_ids), prompt_ids.device
    _sync(device)
    t0 = time.perf_counter()
    tokens: list[int] = []
    accepted: list[int] = []
    if max_new_tokens > 0:
        cache, ctx = new_cache(), ContextCache()
        logits, hidden = _target_forward(target_model, prompt_ids, cache, hidden=True, logits_to_keep=1)
        _append_taps(ctx, drafter, select_taps(hidden, layer_ids))
        tokens.append(int(_pick(logits[0, -1:], temperature, generator)))
        new = 1
        while not _done(tokens, new, max_new_tokens, eos):
            acc, emitted = _spec_step(target_model, drafter, cache, ctx, tokens[-1], embed_weight,
                                      lm_head_weight, layer_ids, block_size, temperature, generator)
            accepted.append(acc)
            tokens.extend(emitted)
            new = len(emitted)
    tokens, by_eos = _finish(tokens, max_new_tokens, eos)
    _sync(device)
    return SpecResult(tokens, accepted, block_size, time.perf_counter() - t0, by_eos)


@torch.no_grad()
def target_generate(target_model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: Iterable[int],
                    temperature: float = 0.0, generator: torch.Generator | None = None) -> GenResult:
    """Plain autoregressive decoding of one prompt [1, P] with a KV cache and the same stopping rule."""
    eos, device = set(int(e) for e in eos_ids), prompt_ids.device
    _sync(device)
    t0 = time.perf_counter()
    tokens: list[int] = []
    if max_new_tokens > 0:
        cache = new_cache()
        ids = prompt_ids
        while not tokens or not _done(tokens, 1, max_new_tokens, eos):
            logits, _ = _target_forward(target_model, ids, cache, hidden=False, logits_to_keep=1)
            nxt = _pick(logits[0, -1:], temperature, generator)  # [1]
            tokens.append(int(nxt))
            ids = nxt[None]  # [1, 1]
    tokens, by_eos = _finish(tokens, max_new_tokens, eos)
    _sync(device)
    return GenResult(tokens, time.perf_counter() - t0, by_eos)
