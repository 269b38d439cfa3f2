"""Domino (arXiv 2605.29707; SpecForge's `DominoDraftModel`): the DFlash backbone drafting from the
anchor's slot, with a GRU correction of the logits by the tokens drafted before.

Layout (`shift_label`, `pure_draft_prefix_len` 1): the block is [anchor, MASK x (B-1)] and slot s
drafts token anchor + s + 1 for s = 0..B-2, B - 1 tokens a block, as SGLang's rollout drafts them (its
last slot drafts nothing here; SpecForge also trains it, on token anchor + B, which no engine uses).
With e(x) the target's input embedding of token x (scaled as the block's are), x_0 the anchor and x_s
the token slot s - 1 drafted:
    z_0 = T(lm_head(h_0))                                  the pure draft prefix: no correction
    z_s = T(lm_head(h_s) + W2 silu(W1 [h_s; g_s]))         s >= 1
    g_s = GRU(e(x_0), e(x_1), ..., e(x_s))                 the state after the anchor and s drafts
GRU one layer H -> G, W1 [E, H + G], W2 [V, E], none with biases; T the target's logit scaling (a
monotone map: the engines' argmax of the raw sum is the same). Training teacher-forces the data's
tokens (x_s is then the token before the label of slot s), drafting walks the block slot by slot.

Loss (SpecForge's curriculum): (1 - lambda) L(z) + lambda L(z without the correction), L the rows'
loss (`loss.kind`) and lambda = `domino_lambda_start` x (1 - progress / `domino_lambda_decay`),
clamped at 0: the backbone learns alone first, the correction takes over as lambda falls. The
second term costs one more lm_head pass while lambda > 0 (its D-PACE weights, with
`loss.weighting=dpace`, are its own pass's; the decay's are the same for both).

Initialisation: W2 = 0, so a fresh Domino's logits are its backbone's.

Serving (read in SGLang 0.5.23: `dflash_utils.parse_dflash_draft_config`, `models/dflash.py`,
`speculative/domino_utils.py`): SGLang's DFlash drafter (`DFlashDraftModel`, `--speculative-algorithm
DFLASH`) builds the head from `dflash_config.projector_type: "domino"` with `shift_label` true,
`pure_draft_prefix_len` 1, `gru_hidden_dim` G and `emb_dim` E, loads `prefix_gru.weight_ih_l0`
[3G, H], `prefix_gru.weight_hh_l0` [3G, G], `embed_proj.0.weight` [E, H + G] and `embed_proj.2.weight`
[V, E] (a missing one is an error), and drafts greedily from slots 0..B-2 with
`--speculative-num-draft-tokens` B; its default scores each correction over a 2048-token candidate
pool, `--speculative-domino-candidate-pool-size 0` over the whole vocabulary, as trained. vLLM 0.34
has no Domino head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from dflash_train.model.drafter.backbone import DFlashDrafter, anchor_ids, as_blocks, draw, slot_logits
from dflash_train.model.drafter.shape import DrafterShape
from dflash_train.model.drafter.head import SGLANG, VLLM, Engine, Export, Head, ReducedVocab, must_be_positive


@dataclass(frozen=True, kw_only=True)
class DominoSettings:
    domino_gru_dim: int = 1024
    """domino: width G of the GRU state over the anchor and the tokens drafted before (published: 1024)."""
    domino_emb_dim: int = 256
    """domino: bottleneck E of the correction, [h; GRU state] -> E -> vocabulary (published: 256)."""
    domino_lambda_start: float = 1.0
    """domino: weight lambda of the uncorrected logits' loss at the start: (1 - lambda) L(corrected) +
    lambda L(uncorrected) (SpecForge: 1.0)."""
    domino_lambda_decay: float = 0.5
    """domino: share of training over which lambda falls linearly to 0 (SpecForge's default 0.5, its
    Qwen3-8B recipe 1.0)."""


class DominoDrafter(DFlashDrafter):
    drafted_offset = 0

    def __init__(self, cfg: DrafterShape):
        super().__init__(cfg)
        h, g, e = cfg.hidden_size, cfg.domino_gru_dim, cfg.domino_emb_dim
        self.prefix_gru = nn.GRU(h, g, num_layers=1, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(h + g, e, bias=False), nn.SiLU(), nn.Linear(e, cfg.vocab_size,
                                                                                               bias=False))

    @classmethod
    def drafted(cls, block_size: int) -> int:
        return block_size - 1  # slots 0..B-2 (module doc)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """DFlash's init, the GRU's own (uniform in +-1/sqrt(G), nn.GRU's), and W2 = 0."""
        super().reset_parameters(std, generator)
        bound = self.config.domino_gru_dim ** -0.5
        with torch.no_grad():
            for w in self.prefix_gru.parameters():
                w.copy_(torch.rand(w.shape, generator=generator) * 2 * bound - bound)
            self.embed_proj[2].weight.zero_()

    def lambda_at(self, progress: float) -> float:
        """The uncorrected logits' share of the loss after `progress` of training (module doc)."""
        decay, start = self.config.domino_lambda_decay, self.config.domino_lambda_start
        return 0.0 if decay <= 0 else start * max(0.0, 1.0 - progress / decay)

    def _correction(self, rows: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """silu(W1 [h; g]) [..., E] of rows [..., H] and GRU states [..., G]."""
        proj = self.embed_proj[0]
        return self.embed_proj[1](proj(torch.cat([rows.to(proj.weight.dtype), states.to(proj.weight.dtype)], -1)))

    def logit_bias(self, prev, vocab_ids=None, rows=None, embed=None):
        if embed is None or rows is None:
            raise ValueError("the domino head reads the rows and the drafted tokens' embeddings: pass `rows`, `embed`")
        rows, prev = as_blocks(rows, prev)  # [M, D, H], [M, D]
        gru = self.prefix_gru
        states = gru(embed(prev).to(gru.weight_ih_l0.dtype))[0]  # [M, D, G]: slot s after x_0 .. x_s
        latent = self._correction(rows, states)  # [M, D, E]
        slot = torch.arange(prev.shape[1], device=latent.device)
        latent = latent * (slot >= 1).to(latent.dtype)[None, :, None]  # slot 0: the pure draft prefix
        weight = self.embed_proj[2].weight  # [V, E]
        return latent.reshape(-1, latent.shape[-1]), weight if vocab_ids is None else weight[vocab_ids]

    def extra_loss(self, rows, out, labels, prev, vocab_ids, weight: float, has_tv: bool, terms=None):
        """lambda (L(uncorrected) - L(corrected)), summed over the rows as the rows' loss is: with it the
        rows' loss is the curriculum's mix."""
        lam = self.lambda_at(terms.progress) if terms is not None else 0.0
        if lam <= 0 or terms.unbiased is None:
            return None, None
        return weight * lam * (terms.unbiased().loss_sum - out.loss_sum), None

    def greedy(self, rows, prev, logits_fn, embed=None):
        blocks, prev_blocks = as_blocks(rows, prev)
        latent, _ = self.logit_bias(prev_blocks, None, blocks, embed)
        bias = self.embed_proj[2](latent)  # [M*D, V]
        return logits_fn(blocks.reshape(-1, blocks.shape[-1]), bias=bias).argmax(-1).view(prev.shape)

    def propose(self, rows, anchor: "int | torch.Tensor", logits_fn, temperature: float, generator=None, embed=None):
        """Slot 0 from the backbone alone, then each slot corrected by the GRU state after the anchor
        and the tokens drafted so far (SGLang's rollout; sampled from each corrected row at T > 0)."""
        tokens, qs, state = [], [], None
        dtype = self.prefix_gru.weight_ih_l0.dtype
        at = slot_logits(logits_fn, rows)  # the lm_head of every slot at once; the correction needs the tokens before
        for i in range(rows.shape[0]):
            bias = None if state is None else self.embed_proj[2](self._correction(rows[i:i + 1], state[0]))
            token, q = draw(at(i, bias=bias), temperature, generator)  # [1]; [1, V] or None
            if q is not None:
                qs.append(q[0])
            tokens.append(token)
            if i + 1 < rows.shape[0]:  # the state the next slot reads: over the anchor first, then each draft
                seen = torch.cat([anchor_ids(anchor, token.device), token]) if state is None else token
                _, state = self.prefix_gru(embed(seen.to(rows.device))[None].to(dtype), state)
        return torch.cat(tokens), (torch.stack(qs) if qs else None)


def _problems(s, hidden_size: int | None) -> list[str]:
    out = must_be_positive(s, ("domino_gru_dim", "domino_emb_dim"))
    for name in ("domino_lambda_start", "domino_lambda_decay"):
        if not 0 <= getattr(s, name) <= 1:
            out.append(f"{name}={getattr(s, name)}: must be in [0, 1]")
    return out


def _parameters(cfg) -> int:
    """The GRU's input and recurrent weights [3G, H] and [3G, G], W1 [E, H + G] and W2 [V, E]."""
    h, g, e = cfg.hidden_size, cfg.domino_gru_dim, cfg.domino_emb_dim
    return 3 * g * (h + g) + e * (h + g) + cfg.vocab_size * e


HEAD = Head(
    name="domino", module=DominoDrafter, settings=DominoSettings,
    published_block=16,  # SpecForge's Qwen3-8B and Qwen3.5-4B Domino configs
    export=Export(("DFlashDraftModel",), keys=(("gru_hidden_dim", "domino_gru_dim"), ("emb_dim", "domino_emb_dim")),
                  constants=(("projector_type", "domino"), ("shift_label", True), ("pure_draft_prefix_len", 1)),
                  marks=(("projector_type", "domino"),), also_read=(("DominoDraftModel",),),
                  reduced_vocab=ReducedVocab(ignored_by=(SGLANG,), not_exported=(
                      "vLLM does not serve Domino, and SGLang's DFlash loader skips lm_head and d2t "
                      "(python/sglang/srt/models/dflash.py DFlashDraftModel.load_weights)"))),
    engines=(Engine(VLLM, refused="vLLM 0.34's DFlash drafter has no Domino head (qwen3_dflash.py builds no "
                                  "prefix_gru or embed_proj, and its loader raises on their weights)"),
             Engine(SGLANG, "DFLASH", extra_tokens=1, flags="--speculative-domino-candidate-pool-size 0")),
    problems=_problems, parameters=_parameters, outside_muon=("prefix_gru", "embed_proj.2"),
    small=(("domino_gru_dim", 32), ("domino_emb_dim", 16)),
)
