"""The eval's plain and speculative greedy loops as an engine runs them: fixed shapes, state on the device.

`spec_decode.py`'s loops (eager HF, a DynamicCache cropped after every verify, the drafter's context
grown by torch.cat, a host read per token) cost a draft+verify cycle 1.7-2.1 plain steps on an H200,
a price no engine pays (issue 37). Here, per 64-token length bucket of `prompt + max_new_tokens +
verify width` (`graph_decode.bucket_length`), one set of buffers is kept for the whole eval:

- the target's `StaticCache`: the verify pass writes its V = D + 1 positions from the cycle's start
  and the rejected tail is rewound by offset (each layer's write position set back to the verified
  length on the device; the stale slots are masked out, then overwritten), never cropped or copied;
- the drafter's context K/V in [1, Hkv, L, hd] buffers: the taps of all V verified positions are
  projected and written from the start, the length advances by acc + 1, and the draft attends to the
  whole buffer under a mask that hides slots at or past the length (and applies the drafter's window);
- the anchor, the verified length, the tokens, acc and the top-2 gaps as device tensors: draft, verify
  and greedy acceptance run without a host sync, and the host reads one small tensor per cycle
  ([acc, the verify's argmaxes]) to apply the stopping rule.

On CUDA the cycle (draft + verify + acceptance + context append) and the plain step are each replayed
as one CUDA graph per bucket (`graph_decode.CapturedStep`, captured after the bucket's first step ran
eagerly), and so is the prefill, per bucket, prompt length rounded up to 64 and kind (with the taps and the
drafter's context, or plain): the prompt right-padded in a fixed buffer, the logits of its last real
position alone (`logits_to_keep` as a device index). The padded slots of the cache and the context are
hidden by the masks above (past the verified length) and written over by the steps. Eager, the prefills
were 10.9 of the eval's 62.2 s on an H100 (docs/LOG.md, session 29: ~1,560 kernel launches a forward);
on the CPU the prompt is not padded (padding there is compute, not launches saved). Greedy only (sampled
decoding keeps `spec_decode`'s loops), batch 1, the drafter on the target's device, targets whose layers all attend fully (`graph_decode.supports`). Outputs equal
`spec_decode`'s token for token in float32 on the CPU (tests/eval/test_static_decode.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash_train.data.graph_decode import CapturedStep, bucket_length, decode_attention, supports
from dflash_train.eval import few_rows
from dflash_train.eval.spec_decode import DraftHead, GenResult, SpecResult, _done, _finish, _sync, top2_gap
from dflash_train.model.drafter.attention import SLIDING
from dflash_train.model.target.decoding import cache_kwarg
from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.target.scaling import scale_embeddings
from dflash_train.model.target.taps import select_taps


def static_reason(target_model, drafter: DFlashDrafter, temperature: float) -> str | None:
    """Why the fixed-shape loops cannot run this pair (None: they can)."""
    if temperature > 0:
        return "sampled decoding (temperature > 0) keeps the dynamic loop"
    if not supports(target_model):
        return "the target has layers that do not attend to the whole cache (sliding or linear) or is sharded"
    if next(drafter.parameters()).device != target_model.get_input_embeddings().weight.device:
        return "the drafter sits on another device than the target"
    return None


@dataclass
class _Bucket:
    """One length bucket's buffers and captured steps."""

    length: int
    cache: object
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]
    cycle: CapturedStep
    plain: CapturedStep
    prefills: dict = field(default_factory=dict)  # (padded prompt length, taps) -> _Prefill


@dataclass
class _Prefill:
    """A padded prompt length's input buffer and captured prefill."""

    ids: torch.Tensor  # [1, padded length]
    step: CapturedStep


class StaticDecoder:
    """Plain and speculative greedy decoding of one prompt at a time through fixed-shape buffers."""

    def __init__(self, target_model, drafter: DFlashDrafter, embed_weight: torch.Tensor, head: DraftHead, layer_ids,
                 block_size: int, max_new_tokens: int, use_graph: bool | None = None):
        self.model, self.drafter, self.embed_weight, self.head = target_model, drafter, embed_weight, head
        self.layer_ids, self.block, self.max_new = list(layer_ids), block_size, max_new_tokens
        self.device = embed_weight.device
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        self.drafted = drafter.drafted(block_size)  # D
        self.width = self.drafted + 1  # V: the anchor and the drafts, verified in one forward
        self.cache_arg = cache_kwarg(type(target_model))
        self.dtype = target_model.get_input_embeddings().weight.dtype
        dev, long = self.device, torch.long
        self.length = torch.zeros((), dtype=long, device=dev)  # verified positions = the anchor's position
        self.anchor = torch.zeros(1, dtype=long, device=dev)
        self.first_out = torch.zeros((), dtype=long, device=dev)  # output index of the token after the anchor
        self.out = torch.zeros(1 + self.width, dtype=long, device=dev)  # [acc, the verify's argmaxes]
        self.gaps = torch.zeros(max_new_tokens + self.width + 1, dtype=torch.float32, device=dev)
        self.last = torch.zeros(1, dtype=long, device=dev)  # the prompt's last real position (padded prefills)
        self.pad_prefill = self.use_graph  # captured prefills of padded prompts (tests set it on the CPU)
        self.buckets: dict[int, _Bucket] = {}
        self.bucket: _Bucket | None = None

    # -- buffers ---------------------------------------------------------------------------------

    def bucket_of(self, prompt_len: int) -> int:
        """The cache length a prompt of this many tokens decodes in (one set of buffers and graphs each)."""
        return bucket_length(prompt_len + self.max_new + self.width)

    def shapes_of(self, prompt_len: int) -> tuple[int, int | None]:
        """The fixed shapes a prompt of this many tokens decodes in: its bucket and, where prefills are padded, its
        padded length (a prompt of each pair of them captures every graph it needs: the eval's warm-up)."""
        return self.bucket_of(prompt_len), bucket_length(prompt_len) if self.pad_prefill else None

    def _fit(self, prompt_len: int) -> _Bucket:
        length = self.bucket_of(prompt_len)
        if length not in self.buckets:
            from transformers import StaticCache

            cfg, p = self.drafter.config, next(self.drafter.parameters())
            shape = (1, cfg.num_kv_heads, length, cfg.head_dim)
            ctx_kv = [(torch.zeros(shape, dtype=p.dtype, device=p.device), torch.zeros(shape, dtype=p.dtype,
                                                                                      device=p.device))
                      for _ in range(cfg.num_layers)]
            self.buckets[length] = _Bucket(length, StaticCache(config=self.model.config, max_cache_len=length),
                                           ctx_kv, CapturedStep(self._cycle, self.use_graph, "eval"),
                                           CapturedStep(self._plain_step, self.use_graph, "eval"))
        return self.buckets[length]

    def _rewind(self) -> None:
        """Every target layer writes its next positions from the verified length (the rejected tail's
        slots are simply written over). One multi-tensor copy (the optimizers' `_foreach` kernels): on a
        GPU one launch for all layers instead of one copy per layer, 29 of a plain step's ~1,560 kernels
        (bench/decode_census.py)."""
        lengths = [layer.cumulative_length for layer in self.bucket.cache.layers]
        torch._foreach_copy_(lengths, [self.length] * len(lengths))

    def _target_mask(self, queries: int) -> torch.Tensor:
        """Additive mask [1, 1, n, L]: query i (at position length + i) sees the slots up to itself."""
        slots = torch.arange(self.bucket.length, device=self.device)
        seen = slots[None, :] <= self.length + torch.arange(queries, device=self.device)[:, None]
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~seen, torch.finfo(self.dtype).min)[None, None]

    def _target(self, ids: torch.Tensor, taps: bool, keep: int):
        n = ids.shape[1]
        self._rewind()
        positions = (self.length + torch.arange(n, device=self.device))[None]
        out = self.model(input_ids=ids, attention_mask=self._target_mask(n), position_ids=positions, use_cache=True,
                         output_hidden_states=taps, logits_to_keep=keep, **{self.cache_arg: self.bucket.cache})
        return out.logits[0], (select_taps(out.hidden_states, self.layer_ids) if taps else None)

    def _append_context(self, taps: torch.Tensor) -> None:
        """Project the taps [1, n, K*H] of positions length.. and write them into the context buffers."""
        p = next(self.drafter.parameters())
        positions = self.length + torch.arange(taps.shape[1], device=self.device)
        new = self.drafter.context_kv(self.drafter.fuse_context(taps.to(p.device, p.dtype)), positions[None])
        for (k_buf, v_buf), (k, v) in zip(self.bucket.ctx_kv, new):
            k_buf.index_copy_(2, positions, k)
            v_buf.index_copy_(2, positions, v)

    def _draft_masks(self) -> dict:
        """Per drafter layer type, the boolean mask [1, 1, B, L + B] of the block over the context
        buffers and itself: the verified context slots and the whole block (full attention, as
        `DFlashDrafter.draft` attends unmasked); sliding layers also keep the window and, for
        `window_causal` drafters, causality (`attention.inference_mask`)."""
        cfg, length, block = self.drafter.config, self.bucket.length, self.block
        slots = torch.arange(length + block, device=self.device)
        visible = ((slots >= length) | (slots < self.length))[None].expand(block, -1)  # [B, L + B]
        masks = {t: visible[None, None] for t in set(cfg.layer_types)}
        if SLIDING in masks:
            key_pos = torch.where(slots < length, slots, self.length + slots - length)[None]
            q_pos = (self.length + torch.arange(block, device=self.device))[:, None]
            windowed = visible & (key_pos >= q_pos - (cfg.sliding_window - 1))
            masks[SLIDING] = (windowed & (key_pos <= q_pos) if cfg.window_causal else windowed)[None, None]
        return masks

    # -- the steps (each captured as a CUDA graph per bucket) --------------------------------------

    def _draft(self) -> torch.Tensor:
        """The drafts [D] of the block [anchor, MASK x (B-1)] at the verified length."""
        d, p = self.drafter, next(self.drafter.parameters())
        ids = torch.cat([self.anchor, self.anchor.new_full((self.block - 1,), d.config.mask_token_id)])
        scale = d.config.input_embedding_scale
        embeds = scale_embeddings(self.embed_weight[ids], scale).to(p.device, p.dtype)[None]  # [1, B, H]
        positions = (self.length + torch.arange(self.block, device=self.device))[None]
        hidden = d.run_layers(embeds, self.bucket.ctx_kv, positions, self._draft_masks(), "sdpa", self.block)[0]
        rows = hidden[d.drafted_offset:d.drafted_offset + self.drafted]  # [D, H]

        def embed(tokens: torch.Tensor) -> torch.Tensor:
            return scale_embeddings(self.embed_weight[tokens.to(self.device)], scale).to(p.device, p.dtype)

        draft, _ = d.propose(rows, self.anchor, self.head, 0.0, None, embed=embed)
        return draft.to(self.device)

    def _cycle(self) -> None:
        draft = self._draft()
        logits, taps = self._target(torch.cat([self.anchor, draft])[None], taps=True, keep=0)  # [V, vocab]
        argmax = logits.argmax(-1)  # row k: the token after slot k
        acc = (draft == argmax[:-1]).long().cumprod(0).sum()
        rows = self.first_out + torch.arange(self.width, device=self.device)
        self.gaps.index_copy_(0, rows, top2_gap(logits))  # rows past acc are written over by the next cycle
        self._append_context(taps)
        self.out[0].copy_(acc)
        self.out[1:].copy_(argmax)
        self.anchor.copy_(argmax.gather(0, acc.reshape(1)))  # a gather: indexing by a 0-d tensor reads it on the host
        self.length.add_(acc + 1)
        self.first_out.add_(acc + 1)

    def _plain_step(self) -> None:
        logits, _ = self._target(self.anchor[None], taps=False, keep=1)
        self.out[1].copy_(logits[-1].argmax())
        self.anchor.copy_(self.out[1:2])
        self.length.add_(1)

    # -- the loops ---------------------------------------------------------------------------------

    def _prefill(self, prompt_ids: torch.Tensor, taps: bool) -> None:
        """The prompt into the bucket's cache (and the drafter's context); the first token as the anchor."""
        n = prompt_ids.shape[1]
        self.bucket = self._fit(n)
        self.bucket.cache.reset()
        self.length.zero_()
        if self.pad_prefill:
            padded = self._padded_prefill(n, taps)
            padded.ids[:, :n].copy_(prompt_ids)
            padded.ids[:, n:].zero_()  # any token: the padded positions come after the prompt's, which never see them
            self.last.fill_(n - 1)
            padded.step()
        else:
            self._prefill_forward(prompt_ids, taps, keep=1)
        self.first_out.fill_(1)
        self.length.fill_(n)

    def _padded_prefill(self, prompt_len: int, taps: bool) -> _Prefill:
        padded_len = bucket_length(prompt_len)
        key = (padded_len, taps)
        if key not in self.bucket.prefills:
            ids = torch.zeros(1, padded_len, dtype=torch.long, device=self.device)
            step = CapturedStep(lambda: self._prefill_forward(ids, taps, keep=self.last), self.use_graph, "eval")
            self.bucket.prefills[key] = _Prefill(ids, step)
        return self.bucket.prefills[key]

    def _prefill_forward(self, ids: torch.Tensor, taps: bool, keep) -> None:
        """The target over `ids` from position 0, its taps into the drafter's context; the anchor and its gap
        from the logits kept (`keep`: 1, the last row, or a device index [1] of the last real position)."""
        logits, tapped = self._target(ids, taps=taps, keep=keep)
        if taps:
            self._append_context(tapped)
        self.anchor.copy_(logits[-1:].argmax(-1))
        self.gaps[:1].copy_(top2_gap(logits[-1:]))

    @torch.no_grad()
    def speculative(self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids) -> SpecResult:
        eos = set(int(e) for e in eos_ids)
        _sync(self.device)
        t0 = time.perf_counter()
        tokens: list[int] = []
        accepted: list[int] = []
        first = 0.0
        if max_new_tokens > 0:
            with decode_attention(self.model), few_rows.few_row_mode(self.model, self.device):
                self._prefill(prompt_ids, taps=True)
                tokens.append(int(self.anchor))
                first = time.perf_counter() - t0  # int() waited for the device
                new = 1
                while not _done(tokens, new, max_new_tokens, eos):
                    self.bucket.cycle()
                    out = self.out.tolist()  # the cycle's one host read
                    accepted.append(out[0])
                    tokens.extend(out[1:out[0] + 2])
                    new = out[0] + 1
        tokens, by_eos = _finish(tokens, max_new_tokens, eos)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        return SpecResult(tokens, accepted, self.block, seconds, by_eos, self.gaps[:len(tokens)].tolist(), first)

    @torch.no_grad()
    def plain(self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids) -> GenResult:
        eos = set(int(e) for e in eos_ids)
        _sync(self.device)
        t0 = time.perf_counter()
        tokens: list[int] = []
        first = 0.0
        if max_new_tokens > 0:
            with decode_attention(self.model):
                self._prefill(prompt_ids, taps=False)
                tokens.append(int(self.anchor))
                first = time.perf_counter() - t0  # int() waited for the device
                while not _done(tokens, 1, max_new_tokens, eos):
                    self.bucket.plain()
                    tokens.append(int(self.out[1]))  # the step's one host read
        tokens, by_eos = _finish(tokens, max_new_tokens, eos)
        _sync(self.device)
        return GenResult(tokens, time.perf_counter() - t0, by_eos, first)
