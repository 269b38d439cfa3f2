"""Real speculative decoding with a DFlash drafter against an HF target (spec 1.6), and the plain
autoregressive baseline, both written as the same simple KV-cache loop so they are timed alike.

Conventions:
- Batch size 1. `prompt_ids` is [1, P]; the target's `DynamicCache` holds positions [0, start) and
  the drafter's `ContextCache` holds the taps of the same positions, so `start` is both caches'
  length and the position of the anchor (the last emitted, not yet verified token).
- Taps use z-lab semantics (`model/target/taps.py`): id i is HF `hidden_states[i + 1]`, concatenated
  over `layer_ids`.
- One step: draft block `[anchor, MASK x (B-1)]` at positions [start, start+B), embedded with the
  target's embedding (times `input_embedding_scale`; logits as the target scales them, model/target/scaling.py);
  the drafter proposes D tokens (DFlash: slots 1..B-1, D = B - 1; a head may draft from the
  anchor's slot too, DSpark's D = B), walked as its head drafts (`DFlashDrafter.propose`:
  independently per slot for DFlash, a chain on the previous tokens for the other heads); the
  target reads the anchor and the D drafts in one forward; `acc` = number of accepted draft tokens
  (0..D); the step emits acc + 1 tokens (the
  accepted drafts plus the target's correction/bonus token), the target cache is cropped to
  start+acc+1 and the drafter cache gets the taps of positions start..start+acc.
- Greedy (temperature 0): acc = longest prefix with draft[k] == target_argmax[k-1], so the output
  equals plain greedy decoding token for token (up to floating-point ties).
- temperature > 0: standard speculative rejection sampling (accept x with prob min(1, p(x)/q(x)),
  on rejection sample norm(max(p - q, 0)), after full acceptance sample the bonus from p), so the
  output distribution equals the target's. DFlash drafts all slots independently given the
  context; DFlash 2's and DSpark's draws depend on the tokens drafted before them, which
  sequential rejection sampling handles exactly as well (q is each token's conditional).
- Stopping (shared by both loops): generation ends after the first token in `eos_ids` (kept in
  the output) or after `max_new_tokens` tokens; tokens a step produced past that are dropped.
- tau (acceptance length, the paper's definition) = tokens produced per verification forward =
  mean over steps of (acc + 1). The first token comes from the prefill and is no step.
- CPU cost (bench/spec_decode_cpu.py, docs/PERF.md): a step's forwards run a few rows (verify B,
  drafter B, drafter lm_head B-1), and on a CPU where it makes the target's own few-token forward
  faster every linear of 2..4 rows runs as `weight @ x.T` (eval/few_rows.py); the plain loop's 1-row
  forward gains nothing from it and runs as is. A draft vocabulary (`DraftHead`) cuts the drafter's
  lm_head to the rows of its training softmax (4,096 of 49,152 in the default).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch
from transformers import DynamicCache

from dflash_train.eval import few_rows
from dflash_train.model.target.decoding import cache_kwarg, new_cache
from dflash_train.model.drafter.backbone import ContextCache, DFlashDrafter
from dflash_train.model.target.scaling import Scaling, scale_embeddings, scale_logits
from dflash_train.model.target.taps import select_taps


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
    gaps: list[float] | None = None
    """Greedy: per emitted token, the top-2 logit gap of the target row it was taken from (token 0: the
    prefill's last row; then the verify pass's rows), read once after the timed loop (eval/lossless.py)."""
    prefill_seconds: float = 0.0
    """Wall time up to the first token (the prefill and its host read), part of `seconds`."""

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
    prefill_seconds: float = 0.0
    """Wall time up to the first token (the prefill and its host read), part of `seconds`."""


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


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [n, V], top-1 minus top-2 logit [n] in float32: how near the argmax was a tie."""
    # the same two values as a topk of the cast logits (a cast keeps the order), without a float32 copy of the rows
    top = logits.topk(2, dim=-1).values.float()
    return top[:, 0] - top[:, 1]


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
def _target_forward(model, ids: torch.Tensor, cache: DynamicCache, taps=None, logits_to_keep: int = 0):
    """Target forward of ids [1, n] after the cached positions; returns (logits [1, n', V], the taps
    [1, n, K*H] of tap ids `taps`, or None when taps is None)."""
    kwargs = {cache_kwarg(type(model)): cache}
    out = model(input_ids=ids, use_cache=True, output_hidden_states=taps is not None,
                logits_to_keep=logits_to_keep, **kwargs)
    return out.logits, (select_taps(out.hidden_states, taps) if taps is not None else None)


# ---------------------------------------------------------------------------------------------
# Draft and verify


@dataclass
class DecodeState:
    """The two caches of one speculative generation; both hold positions [0, ctx.length)."""

    cache: DynamicCache
    """The target's KV cache."""
    ctx: ContextCache
    """The drafter's context K/V (projected taps), appended once per verified position, never
    recomputed (spec 1.6: only context K/V persist across steps)."""


def _param(drafter: DFlashDrafter) -> torch.Tensor:
    """Any drafter parameter: its device and dtype are the drafter's (it may sit on another GPU)."""
    return next(drafter.parameters())


def _append_taps(ctx: ContextCache, drafter: DFlashDrafter, taps: torch.Tensor) -> None:
    p = _param(drafter)
    ctx.append(drafter, taps.to(p.device, p.dtype))


@torch.no_grad()
def prefill(target_model, drafter: DFlashDrafter, prompt_ids: torch.Tensor, layer_ids) -> tuple[DecodeState, torch.Tensor]:
    """Target forward of the prompt [1, P]; returns the state and the last position's logits [1, V]."""
    state = DecodeState(new_cache(), ContextCache())
    logits, taps = _target_forward(target_model, prompt_ids, state.cache, taps=layer_ids, logits_to_keep=1)
    _append_taps(state.ctx, drafter, taps)
    return state, logits[0, -1:]


@torch.no_grad()
def draft_hidden(drafter: DFlashDrafter, ctx: ContextCache, anchor: int, embed_weight: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """Final-normed drafter hidden states [B, H] of the block [anchor, MASK x (B-1)] at ctx.length."""
    start, p = ctx.length, _param(drafter)
    ids = torch.full((1, block_size), drafter.config.mask_token_id, dtype=torch.long, device=embed_weight.device)
    ids[0, 0] = anchor
    embeds = scale_embeddings(embed_weight[ids], drafter.config.input_embedding_scale).to(p.device, p.dtype)  # [1, B, H]
    positions = torch.arange(start, start + block_size, device=p.device)[None]  # [1, B]
    return drafter.draft(embeds, ctx, positions)[0]  # [B, H]


@dataclass
class DraftHead:
    """The lm_head rows the drafter proposes from: all V, or a draft vocabulary (`ids`, the token of each row).

    A draft vocabulary (the tokens the drafter's training softmax ran over, `loss.train_vocab`) is
    the FR-Spec idea (Zhao et al. 2025): the drafter scores only those rows, so on a CPU its lm_head
    costs V'/V of the full one. Lossless: the target verifies every draft, and a token outside the
    subset is simply never proposed. Both paths return full-width logits (-inf outside the subset),
    so rejection sampling compares the same [n, V] distributions either way. The scores become logits as
    the target's do (`output_multiplier`, `final_logit_softcapping`: model/target/scaling.py)."""

    weight: torch.Tensor
    """[V', H] rows scored (the whole lm_head when `ids` is None)."""
    ids: torch.Tensor | None
    """[V'] token id of each row; None: row i is token i."""
    vocab_size: int
    """V, the width of the logits returned."""
    scaling: Scaling = Scaling()
    """The target's logit multiplier and soft cap, which the drafter's config carries."""

    @classmethod
    def of(cls, lm_head_weight: torch.Tensor, ids: torch.Tensor | None = None,
           scaling: Scaling = Scaling(), rows: torch.Tensor | None = None) -> "DraftHead":
        """The whole lm_head [V, H], or its rows at `ids`; `rows` [V', H]: a drafter directory's own reduced lm_head
        (vLLM drafts with it), in the whole one's dtype and device, instead of those rows."""
        if ids is None:
            return cls(lm_head_weight, None, lm_head_weight.shape[0], scaling)
        ids = ids.to(lm_head_weight.device, torch.long)
        weight = lm_head_weight[ids] if rows is None else rows.to(lm_head_weight.device, lm_head_weight.dtype)
        return cls(weight.contiguous(), ids, lm_head_weight.shape[0], scaling)

    def __call__(self, slots: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, V] of slot hidden states [n, H] (n = the drafted tokens), on the weight's device;
        `bias` [n, V] (DSpark's Markov bias) is added before the target's scaling, as in training."""
        return self.logits(self.scores(slots), bias)

    def scores(self, slots: torch.Tensor) -> torch.Tensor:
        """The first half of a call: the raw scores [n, V'] of slots [n, H] (the lm_head's matmul). A head
        that drafts slot by slot scores its whole block with one (`backbone.slot_logits`)."""
        slots = slots.to(self.weight.device, self.weight.dtype)
        return few_rows.project(slots, self.weight)  # [n, V']

    def logits(self, scores: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The second half: logits [n, V] of raw scores [n, V'], the bias [n, V] added before the scaling."""
        if bias is not None:
            bias = bias.to(scores.device, scores.dtype)
            scores = scores + (bias if self.ids is None else bias[:, self.ids])
        scores = scale_logits(scores, self.scaling.output_multiplier, self.scaling.final_logit_softcapping)
        if self.ids is None:
            return scores
        logits = scores.new_full((scores.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.ids] = scores
        return logits


def draft_head(hidden: torch.Tensor, head: "torch.Tensor | DraftHead", scaling: Scaling = Scaling()) -> torch.Tensor:
    """Logits [B-1, V] of slots 1..B-1 from draft_hidden's [B, H], on the lm_head's device; `head`
    is the lm_head weight [V, H] (its logits scaled by `scaling`) or a `DraftHead`."""
    head = head if isinstance(head, DraftHead) else DraftHead.of(head, scaling=scaling)
    return head(hidden[1:])  # [B-1, V]


@torch.no_grad()
def draft_block(drafter: DFlashDrafter, ctx: ContextCache, anchor: int, embed_weight: torch.Tensor,
                head: DraftHead, block_size: int, temperature: float, generator=None):
    """One block's draft: (tokens [D], q [D, V] the distributions they were drawn from, or None when
    greedy), walked as the drafter's head drafts (`DFlashDrafter.propose`)."""
    hidden = draft_hidden(drafter, ctx, anchor, embed_weight, block_size)
    head = head if isinstance(head, DraftHead) else DraftHead.of(head, scaling=drafter.config.scaling)
    first, p = drafter.drafted_offset, _param(drafter)

    def embed(ids: torch.Tensor) -> torch.Tensor:  # drafted tokens' embeddings, for a head that reads them
        rows = scale_embeddings(embed_weight[ids.to(embed_weight.device)], drafter.config.input_embedding_scale)
        return rows.to(p.device, p.dtype)

    rows = hidden[first:first + drafter.drafted(block_size)]  # [D, H]
    return drafter.propose(rows, anchor, head, temperature, generator, embed=embed)


def verify_block(anchor: int, draft: torch.Tensor) -> torch.Tensor:
    """The target's input [1, B]: the anchor, then the B-1 draft tokens (on draft's device)."""
    return torch.cat([torch.tensor([anchor], device=draft.device), draft])[None]


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft [D], target_logits [D + 1, V] -> (acc, next token = target argmax after the accepted prefix)."""
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




def _spec_step(target_model, drafter: DFlashDrafter, state: DecodeState, anchor: int, embed_weight: torch.Tensor,
               head: "torch.Tensor | DraftHead", layer_ids, block_size: int, temperature: float,
               generator) -> tuple[int, list[int], torch.Tensor | None]:
    """One draft + verify step; returns (acc, the acc + 1 emitted tokens, greedy: their verify rows' top-2
    gaps [acc + 1] left on the device)."""
    start, device = state.ctx.length, embed_weight.device
    assert state.cache.get_seq_length() == start, "target and drafter caches out of step"
    # the mode sees every torch call (~3 us each on this CPU): only where it reroutes anything
    with few_rows.few_row_mode(target_model, device):
        draft, q = draft_block(drafter, state.ctx, anchor, embed_weight, head, block_size, temperature, generator)
        draft = draft.to(device)  # [D]
        t_logits, taps = _target_forward(target_model, verify_block(anchor, draft), state.cache, taps=layer_ids)
        gaps = None
        if q is None:
            acc, nxt = accept_greedy(draft, t_logits[0])
            gaps = top2_gap(t_logits[0, :acc + 1])
        else:
            acc, nxt = accept_sampled(draft, q.to(device), _probs(t_logits[0], temperature), generator)
        crop_cache(state.cache, start + acc + 1)  # keep the anchor and the accepted drafts
        _append_taps(state.ctx, drafter, taps[:, : acc + 1])
    return acc, draft[:acc].tolist() + [nxt], gaps


# ---------------------------------------------------------------------------------------------
# The two generation loops


@torch.no_grad()
def speculative_generate(target_model, drafter: DFlashDrafter, embed_weight: torch.Tensor,
                         lm_head_weight: torch.Tensor, layer_ids, prompt_ids: torch.Tensor, max_new_tokens: int,
                         eos_ids: Iterable[int], temperature: float = 0.0,
                         generator: torch.Generator | None = None, block_size: int | None = None,
                         draft_vocab: torch.Tensor | None = None) -> SpecResult:
    """DFlash speculative decoding of one prompt [1, P] (see the module docstring for the rules);
    `lm_head_weight` may be a ready `DraftHead`, else `draft_vocab` ([V'] ids) restricts the drafts."""
    block_size = block_size or drafter.config.block_size
    if isinstance(lm_head_weight, DraftHead) and draft_vocab is not None:
        raise ValueError("speculative_generate: pass draft_vocab or a DraftHead, not both")
    head = lm_head_weight if isinstance(lm_head_weight, DraftHead) else DraftHead.of(
        lm_head_weight, draft_vocab, drafter.config.scaling)
    eos, device = set(int(e) for e in eos_ids), prompt_ids.device
    _sync(device)
    t0 = time.perf_counter()
    tokens: list[int] = []
    accepted: list[int] = []
    gaps: list[torch.Tensor] = []
    first = 0.0
    if max_new_tokens > 0:
        state, logits = prefill(target_model, drafter, prompt_ids, layer_ids)
        tokens.append(int(_pick(logits, temperature, generator)))
        first = time.perf_counter() - t0  # int() above waited for the device
        gaps.append(top2_gap(logits))
        new = 1
        while not _done(tokens, new, max_new_tokens, eos):
            acc, emitted, step_gaps = _spec_step(target_model, drafter, state, tokens[-1], embed_weight, head,
                                                 layer_ids, block_size, temperature, generator)
            accepted.append(acc)
            tokens.extend(emitted)
            gaps.append(step_gaps)
            new = len(emitted)
    tokens, by_eos = _finish(tokens, max_new_tokens, eos)
    _sync(device)
    seconds = time.perf_counter() - t0
    greedy_gaps = torch.cat(gaps)[:len(tokens)].tolist() if temperature <= 0 and gaps else None
    return SpecResult(tokens, accepted, block_size, seconds, by_eos, greedy_gaps, first)


@torch.no_grad()
def target_generate(target_model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: Iterable[int],
                    temperature: float = 0.0, generator: torch.Generator | None = None) -> GenResult:
    """Plain autoregressive decoding of one prompt [1, P] with a KV cache and the same stopping rule."""
    eos, device = set(int(e) for e in eos_ids), prompt_ids.device
    _sync(device)
    t0 = time.perf_counter()
    tokens: list[int] = []
    first = 0.0
    if max_new_tokens > 0:
        cache = new_cache()
        ids = prompt_ids
        while not tokens or not _done(tokens, 1, max_new_tokens, eos):
            logits, _ = _target_forward(target_model, ids, cache, logits_to_keep=1)
            nxt = _pick(logits[0, -1:], temperature, generator)  # [1]
            tokens.append(int(nxt))
            first = first or time.perf_counter() - t0  # the prefill's token: int() waited for the device
            ids = nxt[None]  # [1, 1]
    tokens, by_eos = _finish(tokens, max_new_tokens, eos)
    _sync(device)
    return GenResult(tokens, time.perf_counter() - t0, by_eos, first)
