"""DFlash 2 (z-lab): the DFlash backbone with grouped dynamic convolutions around every sublayer
and a candidate selector that conditions each drafted token on the one before it.

Convolution (dflash2-and-2026-recipe.md 1.2a), per sublayer f with x its normed input at slot t:
    delta_t = kernel_projection(x_t)                         [2, K, H/G] (side, tap, group)
    y_t[c]  = sum_{tau < K, tau <= t} (base[0, tau, c] + delta_t[0, tau, c // G]) x_{t-tau}[c]
    z_t[c]  = sum_{tau <= t}          (base[1, tau, c] + delta_t[1, tau, c // G]) f(y)_{t-tau}[c]
    out     = residual + z
Taps never cross a block boundary: t is the slot inside the block (training shifts inside
[b, N, B, H] views). Initialised as the identity (base[:, 0] = 1, other taps 0, projection 0), so a
fresh DFlash 2 is DFlash 1 (tests).

Selector (1.2c): with u = the unary logits (the target's lm_head on the drafted slot, transformed),
candidates C_i = top-k(u_i), and the edge score of predecessor p -> candidate c
    score_i(p -> c) = u_i[c] + sum_r P[p, r] (W_h h_i)[r] S[c, r]
Drafting walks one chain: p_1 = the anchor, c_i = argmax over C_i of score_i(p_i -> .), p_{i+1} = c_i
(sampled from softmax(score / T) over C_i at T > 0). The successor codebook starts at zero, so the
selector starts as the unary argmax (DFlash 1).

Training objective (chosen here, documented in docs/LOG.md): the unary loss of every row plus
`loss.head_weight` x the k-way cross-entropy of the scores over the candidates, the predecessor
teacher-forced (the data's previous token), a gold token outside the top-k replacing the lowest
candidate (speculators' rule; SpecForge drops such rows), with the unary scores held constant inside
the selector term (the unary logits learn from their own loss; this keeps the lm_head chunked and
fused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_train.model.drafter.backbone import DFlashDecoderLayer, DFlashDrafter, anchor_ids
from dflash_train.model.drafter.shape import DrafterShape
from dflash_train.model.drafter.head import SGLANG, VLLM, Engine, Export, Foreign, Head, ReducedVocab, must_be_positive


@dataclass(frozen=True, kw_only=True)
class DFlash2Settings:
    conv_kernel_size: int = 2
    """dflash2: taps of the grouped dynamic convolutions (z-lab's published drafters: 2)."""
    conv_group_size: int = 16
    """dflash2: channels per dynamic kernel weight (must divide the target's hidden size)."""
    selector_rank: int = 256
    """dflash2: rank of the candidate selector's codebooks."""
    selector_top_k: int = 16
    """dflash2: candidates per drafted slot."""


class GroupedDynamicConv(nn.Module):
    """Both sides of one sublayer's convolution: base_kernel [2, K, H], kernel_projection H -> 2*K*H/G."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def dynamic(self, x: torch.Tensor) -> torch.Tensor:
        """[b, Q, H] normed input -> [b, Q, 2, K, H/G] per-position kernel offsets."""
        b, q, h = x.shape
        return self.kernel_projection(x).view(b, q, 2, self.kernel_size, h // self.group_size)

    def apply(self, x: torch.Tensor, dynamic: torch.Tensor, side: int, block_size: int) -> torch.Tensor:
        """The `side` (0 input, 1 output) convolution of x [b, Q, H] inside blocks of block_size."""
        b, q, h = x.shape
        groups, g = h // self.group_size, self.group_size
        xb = x.view(b, q // block_size, block_size, groups, g)  # [b, N, B, H/G, G]
        dyn = dynamic[:, :, side].reshape(b, q // block_size, block_size, self.kernel_size, groups, 1)
        base = self.base_kernel[side].to(x.dtype)  # [K, H]
        out = None
        for tau in range(self.kernel_size):
            shifted = xb if tau == 0 else F.pad(xb, (0, 0, 0, 0, tau, 0))[:, :, :block_size]  # slot t sees t - tau
            term = (base[tau].view(groups, g) + dyn[:, :, :, tau]) * shifted
            out = term if out is None else out + term
        return out.reshape(b, q, h)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, cfg: DrafterShape, layer_type: str):
        super().__init__(cfg, layer_type)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, ctx_kv, cos, sin, mask, backend: str, block_size: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        kernels = self.attention_conv.dynamic(h)
        a = self.self_attn(self.attention_conv.apply(h, kernels, 0, block_size), ctx_kv, cos, sin, mask, backend)
        x = x + self.attention_conv.apply(a, kernels, 1, block_size)
        h = self.post_attention_layernorm(x)
        kernels = self.mlp_conv.dynamic(h)
        m = self.mlp(self.mlp_conv.apply(h, kernels, 0, block_size))
        return x + self.mlp_conv.apply(m, kernels, 1, block_size)


class CandidateSelector(nn.Module):
    """W_h [r, H] and the codebooks P, S [V, r] (plain parameters: no `.weight` suffix, as exported)."""

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))

    def pair_scores(self, rows: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """sum_r P[prev, r] (W_h h)[r] S[c, r] for rows [T, H], prev [T] and candidates [T, k] token ids."""
        query = self.predecessor_codebook[prev] * self.hidden_projection(rows.to(self.hidden_projection.weight.dtype))
        acc = torch.promote_types(query.dtype, torch.float32)  # scores in >= float32, as vLLM accumulates
        return torch.einsum("tr,tkr->tk", query.to(acc), self.successor_codebook[candidates].to(acc))  # [T, k]


class DFlash2Drafter(DFlashDrafter):
    """DFlash 2: DFlash 1's backbone with convolutions in every layer, and the candidate selector."""

    def __init__(self, cfg: DrafterShape):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)
        self.candidates_per_row = cfg.selector_top_k

    @staticmethod
    def make_layer(cfg: DrafterShape, layer_type: str) -> nn.Module:
        return DFlash2DecoderLayer(cfg, layer_type)

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """DFlash's init, then identity convolutions and a selector that starts as the unary argmax."""
        super().reset_parameters(std, generator)
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        sel = self.candidate_selector
        with torch.no_grad():
            sel.predecessor_codebook.copy_(torch.randn(sel.predecessor_codebook.shape, generator=generator) * std)
            sel.successor_codebook.zero_()

    def extra_loss(self, rows, out, labels, prev, vocab_ids, weight: float, has_tv: bool, terms=None):
        """The selector's k-way CE over the top-k plus the gold token (module doc), and the
        selector's greedy choice among the true top-k, both with the data's previous tokens."""
        acc = torch.promote_types(rows.dtype, torch.float32)
        cand, u = out.topk_ids, out.topk_values.to(acc)  # [T, k], lm_head row space
        extended = torch.cat([cand, labels[:, None]], 1)  # [T, k + 1]: the gold token appended
        scores = torch.cat([u, out.label_logit.to(acc)[:, None]], 1)
        scores = scores + self.candidate_selector.pair_scores(rows, prev, _token_ids(extended, vocab_ids))
        gold_at = cand == labels[:, None]
        inside = gold_at.any(-1)
        # the gold token counts once: in the top-k (drop the appended copy) or appended (drop rank k)
        drop = torch.where(inside, cand.shape[1], cand.shape[1] - 1)
        masked = scores.scatter(1, drop[:, None], float("-inf"))
        target = torch.where(inside, gold_at.float().argmax(-1), cand.shape[1])
        ce = F.cross_entropy(masked, target, reduction="none")
        predicted = cand.gather(1, scores[:, :-1].argmax(-1, keepdim=True)).squeeze(1)
        return weight * ce, predicted

    def greedy(self, rows, prev, logits_fn, embed=None):
        flat, flat_prev = rows.reshape(-1, rows.shape[-1]), prev.reshape(-1)  # each row scores on its own
        unary, cand = logits_fn(flat).topk(self.candidate_selector.top_k, dim=-1)
        scores = self.candidate_selector.pair_scores(flat, flat_prev, cand)
        scores = scores + unary.to(scores.dtype)
        return cand.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1).view(prev.shape)

    def propose(self, rows, anchor: "int | torch.Tensor", logits_fn, temperature: float, generator=None, embed=None):
        """The selector's chain from the anchor (module doc); q: the k-way distribution each token
        was drawn from, scattered onto the vocabulary (zero outside the candidates)."""
        logits = logits_fn(rows)  # [D, V]
        unary, cand = logits.topk(self.candidate_selector.top_k, dim=-1)  # [D, k]
        tokens, qs = [], []
        prev = anchor_ids(anchor, cand.device)
        for i in range(rows.shape[0]):
            pair = self.candidate_selector.pair_scores(rows[i:i + 1], prev.to(rows.device), cand[i:i + 1].to(rows.device))
            scores = unary[i].to(pair.dtype) + pair[0].to(unary.device)
            if temperature <= 0:
                pick = scores.argmax()
            else:
                q = torch.softmax(scores.double() / temperature, dim=-1)
                pick = torch.multinomial(q, 1, generator=generator)[0]
                qs.append(torch.zeros(logits.shape[-1], dtype=q.dtype, device=q.device).scatter(0, cand[i], q))
            prev = cand[i].gather(0, pick.reshape(1))  # not cand[i, pick]: a 0-d index is read on the host
            tokens.append(prev)
        return torch.cat(tokens), (torch.stack(qs) if qs else None)


def _token_ids(index: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """lm_head row indices -> token ids (a training vocabulary's rows are a subset)."""
    return index if vocab_ids is None else vocab_ids[index]


def _problems(s, hidden_size: int | None) -> list[str]:
    out = must_be_positive(s, ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"))
    if hidden_size and s.conv_group_size > 0 and hidden_size % s.conv_group_size:
        out.append(f"conv_group_size {s.conv_group_size} does not divide hidden_size {hidden_size}")
    return out


def _parameters(cfg) -> int:
    """Per layer two convolutions (base kernel [2, K, H], projection H -> 2 K H/G), and the selector
    (W_h [r, H], codebooks P and S [V, r])."""
    h, k = cfg.hidden_size, cfg.conv_kernel_size
    conv = 2 * k * h + h * 2 * k * (h // cfg.conv_group_size)
    return cfg.num_layers * 2 * conv + cfg.selector_rank * (h + 2 * cfg.vocab_size)


HEAD = Head(
    name="dflash2", module=DFlash2Drafter, settings=DFlash2Settings,
    published_block=8,  # z-lab's Qwen3.8-27B DFlash 2
    # vLLM raises a KeyError without the four keys in dflash_config; both engines serve it as DFlash
    export=Export(("DFlash2DraftModel",), keys=tuple((name, name) for name in
                                                     ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k")),
                  reduced_vocab=ReducedVocab(ignored_by=(SGLANG,), not_exported=(
                      "vLLM's DFlash 2 takes its candidates' top-k over the drafter's own lm_head and uses those draft "
                      "ids as token ids, with no d2t (vllm/model_executor/models/qwen3_dflash2.py "
                      "DFlash2Qwen3ForCausalLM.compute_candidates), so it would serve a reduced one wrong"))),
    engines=(Engine(VLLM, "dflash"), Engine(SGLANG, "DFLASH", extra_tokens=1)),
    problems=_problems, parameters=_parameters, outside_muon=("codebook",), small=(("selector_rank", 16),),
    # speculators' DFlash 2 config class trains its sliding layers non-causal inside the block by default
    foreign=Foreign(speculators_type="dflash2", window_non_causal=True),
)
