"""DSpark (arXiv 2607.05147): the DFlash backbone drafting from the anchor's slot too, with a Markov
logit bias on the previous token and a confidence head.

Layout (`sample_from_anchor`): the block is still [anchor, MASK x (B-1)], but slot s drafts token
anchor + s + 1, so a block drafts B tokens (DFlash: B - 1). Slot s's logits are
    z_s = T(lm_head(h_s) + W2 m_s)
with x_s the token before the one it drafts (the anchor for slot 0, then the drafted tokens:
drafting is a short sequential walk over the block; training teacher-forces the data's tokens) and
the Markov latent m_s [r] of `markov_head_type` (SGLang's and speculators' three forms):
    vanilla  m_s = W1[x_s]
    gated    m_s = sigmoid(G [h_s; W1[x_s]] + g) * W1[x_s]
    rnn      [a; c; o] = J [u_s; W1[x_s]; h_s] + j,  m_s = tanh(o),
             u_{s+1} = sigmoid(a) * u_s + (1 - sigmoid(a)) * tanh(c),  u_0 = 0 (per block)
The confidence head predicts each slot's acceptance probability from [h_s; W1[x_s]]; it learns
1 - TV(target, drafter) when the loss carries the target's distribution (the acceptance
probability of speculative sampling), else the drafter's probability of the data token.

Initialisation: W2 = 0, so a fresh DSpark's logits are DFlash's (the bias starts at zero).
Serving: SGLang builds all three forms; vLLM 0.34 only the vanilla one (`qwen3_dspark.py` has no
gate or joint projection, and its loader raises on their weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_train.model.drafter.backbone import DFlashDrafter, anchor_ids, as_blocks, draw, slot_logits
from dflash_train.model.drafter.shape import DrafterShape
from dflash_train.model.drafter.head import SGLANG, VLLM, Engine, Export, Foreign, Head, ReducedVocab, must_be_positive

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True, kw_only=True)
class DSparkSettings:
    markov_rank: int = 256
    """dspark: rank of the Markov logit bias."""
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    """dspark: the Markov bias's form (model/drafter/heads/dspark.py): vanilla W2 W1[x] | gated, W1[x] scaled by a gate on
    [h; W1[x]] | rnn, a state carried along the block. SGLang serves all three, vLLM only vanilla."""


class MarkovHead(nn.Module):
    """The low-rank bias W2 @ m: W1 an embedding [V, r], W2 a linear r -> V, and the gate G ([h; W1[x]]
    -> r) or the joint projection J ([u; W1[x]; h] -> 3r) of the gated and rnn forms (module doc)."""

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.kind, r = cfg.markov_head_type, cfg.markov_rank
        self.markov_w1 = nn.Embedding(cfg.vocab_size, r)
        self.markov_w2 = nn.Linear(r, cfg.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(cfg.hidden_size + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + cfg.hidden_size, 3 * r)

    def step(self, rows: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """(m [..., r], the next state) of rows [..., H] with previous tokens prev [...]; `state` [..., r]
        is the rnn's (None: zero, the block's first slot), passed through by the other forms."""
        emb = self.markov_w1(prev)  # [..., r]
        if self.kind == "vanilla":
            return emb, state
        rows = rows.to(emb.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([rows, emb], dim=-1))) * emb, state
        state = emb.new_zeros(emb.shape) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, emb, rows], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1 - gate) * torch.tanh(candidate)

    def latent(self, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """m [M, D, r] of blocks rows [M, D, H], prev [M, D]: at once, or slot by slot for the rnn."""
        if self.kind != "rnn":
            return self.step(rows, prev, None)[0]
        state, out = None, []
        for k in range(prev.shape[1]):
            m, state = self.step(rows[:, k], prev[:, k], state)
            out.append(m)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)


class DSparkDrafter(DFlashDrafter):
    drafted_offset = 0

    def __init__(self, cfg: DrafterShape):
        super().__init__(cfg)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = ConfidenceHead(cfg)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        super().reset_parameters(std, generator)
        w1 = self.markov_head.markov_w1.weight
        with torch.no_grad():
            w1.copy_(torch.randn(w1.shape, generator=generator) * std)
            self.markov_head.markov_w2.weight.zero_()

    def _prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w1(prev)  # [T, r]

    def logit_bias(self, prev, vocab_ids=None, rows=None, embed=None):
        if rows is None and self.markov_head.kind != "vanilla":
            raise ValueError(f"the {self.markov_head.kind} Markov head reads the rows: pass `rows`")
        rows, prev = as_blocks(rows if rows is not None else prev[..., None], prev)
        latent = self.markov_head.latent(rows, prev)  # [M, D, r]
        weight = self.markov_head.markov_w2.weight  # [V, r]
        return latent.reshape(-1, latent.shape[-1]), weight if vocab_ids is None else weight[vocab_ids]

    def acceptance_logits(self, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[T] logits of each drafted token's acceptance probability: the confidence head."""
        features = torch.cat([rows, self._prev_embedding(prev).to(rows.dtype)], dim=-1)
        return self.confidence_head.proj(features.to(self.confidence_head.proj.weight.dtype)).squeeze(-1)

    def extra_loss(self, rows, out, labels, prev, vocab_ids, weight: float, has_tv: bool, terms=None):
        """The confidence head's binary cross-entropy against the acceptance probability (module doc)."""
        target = (1 - out.tv) if has_tv else out.label_logprob.exp()
        logits = self.acceptance_logits(rows, prev)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return weight * F.binary_cross_entropy_with_logits(logits, target.detach().to(logits.dtype).clamp(0, 1),
                                                            reduction="none"), None

    def _bias(self, latent: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w2(latent.to(self.markov_head.markov_w2.weight.dtype))  # [T, V]

    def greedy(self, rows, prev, logits_fn, embed=None):
        """logits_fn(rows, bias) adds the bias [T, V] before the target's logit scaling (`DraftHead`)."""
        blocks, prev_blocks = as_blocks(rows, prev)
        latent = self.markov_head.latent(blocks, prev_blocks)  # [M, D, r]
        bias = self._bias(latent.reshape(-1, latent.shape[-1]))
        return logits_fn(blocks.reshape(-1, blocks.shape[-1]), bias=bias).argmax(-1).view(prev.shape)

    def propose(self, rows, anchor: "int | torch.Tensor", logits_fn, temperature: float, generator=None, embed=None):
        """Slot by slot: the bias of the token just drafted (the anchor first) on the slot's logits."""
        prev, state = anchor_ids(anchor, rows.device), None
        tokens, qs = [], []
        at = slot_logits(logits_fn, rows)  # the lm_head of every slot at once; the bias needs the token before
        for i in range(rows.shape[0]):
            latent, state = self.markov_head.step(rows[i:i + 1], prev, state)
            z = at(i, bias=self._bias(latent))  # [1, V]
            token, q = draw(z, temperature, generator)
            if q is not None:
                qs.append(q[0])
            tokens.append(token)
            prev = token.to(rows.device)
        return torch.cat(tokens), (torch.stack(qs) if qs else None)


def _problems(s, hidden_size: int | None) -> list[str]:
    out = must_be_positive(s, ("markov_rank",))
    if s.markov_head_type not in MARKOV_HEAD_TYPES:
        out.append(f"markov_head_type={s.markov_head_type!r}: expected one of {', '.join(MARKOV_HEAD_TYPES)}")
    return out


def _parameters(cfg) -> int:
    """W1 and W2 [V, r], the confidence projection [1, H + r] and its bias, and the gate [r, H + r] or the
    joint projection [3r, 2r + H] with their biases."""
    h, r = cfg.hidden_size, cfg.markov_rank
    form = {"vanilla": 0, "gated": (h + r) * r + r, "rnn": (2 * r + h) * 3 * r + 3 * r}[cfg.markov_head_type]
    return 2 * cfg.vocab_size * r + h + r + 1 + form


def _foreign_heads(d: dict) -> tuple[dict, tuple[str, ...]]:
    """Our keys for another trainer's DSpark config, and the parts it lacks, which drafting reads as ours with
    zeros: no Markov head is a zero bias (rank 1, W2 = 0); no confidence head is never read when drafting; one
    that reads the hidden state alone is ours with zero weights on the Markov input. (DeepSpec's DFlash is
    such a DSpark: drafting from the anchor's slot, with neither head.)"""
    rank = d.get("markov_rank", 256)  # speculators' default; DeepSpec always writes it
    keys = {"markov_rank": rank or 1, "markov_head_type": d.get("markov_head_type", "vanilla") if rank else "vanilla",
            "enable_confidence_head": True, "confidence_head_with_markov": True, "sample_from_anchor": True}
    missing = () if rank else ("markov",)
    if not d.get("enable_confidence_head", True):
        missing += ("confidence",)
    elif not (rank and d.get("confidence_head_with_markov", True)):
        missing += ("confidence_markov_input",)
    return keys, missing


def _fill_missing(tensors: dict, cfg, missing: tuple[str, ...]) -> dict:
    """The parts `_foreign_heads` found missing, as drafting reads them: zeros."""
    h, r, v = cfg.hidden_size, cfg.markov_rank, cfg.vocab_size
    out = dict(tensors)
    if "markov" in missing:
        out["markov_head.markov_w1.weight"], out["markov_head.markov_w2.weight"] = torch.zeros(v, r), torch.zeros(v, r)
    if "confidence" in missing:
        out["confidence_head.proj.weight"], out["confidence_head.proj.bias"] = torch.zeros(1, h + r), torch.zeros(1)
    if "confidence_markov_input" in missing and "confidence_head.proj.weight" in out:
        w = out["confidence_head.proj.weight"]  # [1, H]: the hidden state alone
        out["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(1, r)], dim=-1)
    return out


FOREIGN = Foreign(
    speculators_type="dspark", from_anchor=True, deepspec=True,
    deepspec_defaults=(("enable_confidence_head", False),),  # DeepSpec's config class; speculators' is True
    heads=_foreign_heads, fill=_fill_missing,
    notes=(("markov", "no Markov head in the checkpoint: ours with a zero bias"),
           ("confidence", "no confidence head in the checkpoint (drafting reads none)"),
           ("confidence_markov_input", "its confidence head reads the hidden state alone: ours with zero weights "
                                       "on the Markov input")),
)


# A reduced draft vocabulary: vLLM's Qwen3DSparkForCausalLM serves it (lm_head [n, H], d2t, and the Markov bias in
# draft space: markov_w2 [draft_vocab_size, r] while markov_w1 stays [vocab_size, r], embedding the previous target
# token; vllm/model_executor/models/qwen3_dspark.py DSparkMarkovHead / load_weights). SGLang builds markov_w2 with
# vocab_size rows and loads the checkpoint's through default_weight_loader, which asserts equal shapes
# (python/sglang/srt/models/dspark.py build_markov_head / DSparkDraftMixin.load_weights): a reduced export would
# stop SGLang from loading it, so ours keep the whole vocabulary. A reduced checkpoint from elsewhere is read for
# the eval (as vLLM serves it) with its markov_w2 rows put back at the draft ids.
REDUCED_VOCAB = ReducedVocab(
    served_by=(VLLM,), draft_rows=("markov_head.markov_w2.weight",),
    not_exported="SGLang builds markov_w2 with vocab_size rows and its loader refuses a reduced one "
                 "(python/sglang/srt/models/dspark.py build_markov_head, DSparkDraftMixin.load_weights)")


def _refusals(cfg) -> dict[str, str]:
    if cfg.markov_head_type == "vanilla":
        return {}
    return {VLLM: f"vLLM 0.34 builds only the vanilla Markov head (qwen3_dspark.py: markov_w1 and markov_w2), "
                  f"and its loader raises on this {cfg.markov_head_type} head's weights"}


HEAD = Head(
    name="dspark", module=DSparkDrafter, settings=DSparkSettings,
    published_block=8,  # speculators' DSpark
    # engine-formats.md A: the flat format DeepSeek's DeepSpec writes, which vLLM and SGLang both load.
    # At the top level: vLLM reads DSpark's keys there only (vllm/model_executor/models/qwen3_dspark.py,
    # spec_decode/dspark/config.py), and its DFlash base class, which DSpark's speculator runs first,
    # refuses a truthy `dflash_config.sample_from_anchor` (v1/worker/gpu/spec_decode/dflash/speculator.py);
    # SGLang reads `markov_rank` and `markov_head_type` from either place, `sample_from_anchor` from the
    # top level only; DeepSeek's DeepSpec exporter writes them all at the top level.
    export=Export(("Qwen3DSparkModel",),
                  keys=(("markov_rank", "markov_rank"), ("markov_head_type", "markov_head_type")),
                  constants=(("enable_confidence_head", True), ("confidence_head_with_markov", True),
                             ("sample_from_anchor", True)),
                  top_level=True, also_read=(("DSparkDraftModel",),), reduced_vocab=REDUCED_VOCAB),
    engines=(Engine(VLLM, "dspark"), Engine(SGLANG, "DSPARK", extra_tokens=1)), refusals=_refusals,
    problems=_problems, parameters=_parameters, outside_muon=("markov",), small=(("markov_rank", 16),),
    foreign=FOREIGN,
)
