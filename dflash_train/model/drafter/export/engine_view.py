"""A drafter directory as vLLM and SGLang see it: their config parse, their weight names, and a
one-block draft forward written from their side, independently of `drafter.py`.

The engines read config.json through transformers' `Qwen3Config` (so a missing `head_dim` becomes
128 and a missing `rope_theta` 10000, whatever the trainer used), accept an optional `model.`
weight prefix, fuse q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, and skip names they do
not know. The forward below follows z-lab's `DFlashDraftModel` with those conventions: context K/V
from `hidden_norm(fc(taps))` at positions [0, C), the block [anchor, MASK...] at [C, C+B),
bidirectional in full-attention layers and causal (windowed) in sliding ones, unless `is_causal`
or `dflash_config.causal` says otherwise (vLLM `_dflash_layer_causal`). The block's embeddings and the
draft logits follow the target's scaling as z-lab's reference `dflash` reads it (`engine_scaling`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_train.model.drafter.config import rope_theta_of

SKIPPED_PREFIX = "model."
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def engine_config(model_dir: str | Path):
    """config.json parsed afresh, as the engines do (a DFlashDraftModel with model_type qwen3)."""
    from transformers import Qwen3Config  # heavy import, only when a drafter is checked

    return Qwen3Config.from_pretrained(str(model_dir), local_files_only=True)


def engine_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engines' name mapping: strip `model.`, fuse q/k/v and gate/up per layer."""
    plain = {name.removeprefix(SKIPPED_PREFIX): t for name, t in tensors.items()}
    mapped = dict(plain)
    layers = {name.split(".")[1] for name in plain if name.startswith("layers.")}
    for i in sorted(layers):
        for fused, parts in FUSED.items():
            group = fused.split(".")[0]  # self_attn / mlp
            for param in ("weight", "bias"):
                names = [f"layers.{i}.{group}.{part}.{param}" for part in parts]
                if all(n in plain for n in names):
                    mapped[f"layers.{i}.{fused}.{param}"] = torch.cat([mapped.pop(n) for n in names], dim=0)
    return mapped


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, heads, hd] rotated at positions [L], neox layout (rotate the two halves)."""
    hd = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.float()[:, None] * inv_freq  # [L, hd/2]
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]  # [L, 1, hd]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    bias = w.get(name + ".bias")
    return F.linear(x, w[name + ".weight"].float(), None if bias is None else bias.float())


def _layer_is_causal(hf, dflash: dict, i: int) -> bool:
    if getattr(hf, "is_causal", None) is not None:
        return bool(hf.is_causal)
    if dflash.get("causal") is not None:
        return bool(dflash["causal"])
    return hf.layer_types[i] == "sliding_attention"


def _visible(hf, dflash: dict, i: int, context_len: int, block_len: int) -> torch.Tensor:
    """[B, C+B] keys each block query sees."""
    q_pos = context_len + torch.arange(block_len)[:, None]
    k_pos = torch.arange(context_len + block_len)[None, :]
    visible = torch.ones(block_len, context_len + block_len, dtype=torch.bool)
    if _layer_is_causal(hf, dflash, i):
        visible &= k_pos <= q_pos
    if hf.layer_types[i] == "sliding_attention" and hf.sliding_window:
        visible &= k_pos > q_pos - hf.sliding_window
    return visible


def _attention(hf, w: dict, p: str, h: torch.Tensor, ctx: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """One layer's attention: h [B, H] block (normed), ctx [C, H] fused context -> [B, H]."""
    hd, n_q, n_kv = hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads
    theta, eps = rope_theta_of(hf), hf.rms_norm_eps
    C, B = ctx.shape[0], h.shape[0]
    sizes = [n_q * hd, n_kv * hd, n_kv * hd]
    wq, wk, wv = w[p + "self_attn.qkv_proj.weight"].float().split(sizes)  # the engines' fused qkv
    bias = w.get(p + "self_attn.qkv_proj.bias")
    bq, bk, bv = bias.float().split(sizes) if bias is not None else (None, None, None)
    kv_in = torch.cat([ctx, h], dim=0)  # [C+B, H]: context keys first, then the block's
    q = _rms(F.linear(h, wq, bq).view(B, n_q, hd), w[p + "self_attn.q_norm.weight"], eps)
    k = _rms(F.linear(kv_in, wk, bk).view(C + B, n_kv, hd), w[p + "self_attn.k_norm.weight"], eps)
    v = F.linear(kv_in, wv, bv).view(C + B, n_kv, hd)
    positions = torch.arange(C + B)
    q, k = _rope(q, positions[C:], theta), _rope(k, positions, theta)
    groups = n_q // n_kv
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [C+B, n_q, hd]
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5  # [n_q, B, C+B]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(B, n_q * hd)
    return _linear(out, w, p + "self_attn.o_proj")


def _convolve(x: torch.Tensor, coef_base: torch.Tensor, coef_dyn: torch.Tensor, group: int) -> torch.Tensor:
    """DFlash 2's grouped dynamic causal convolution over one block (vLLM DFlash2Qwen3DecoderLayer):
    out[t, c] = sum_tau (base[tau, c] + dyn[t, tau, c // group]) * x[t - tau, c], zero before the block.
    x [B, H]; coef_base [K, H]; coef_dyn [B, K, H/G]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for tau in range(min(coef_base.shape[0], t + 1)):
            coef = coef_base[tau] + coef_dyn[t, tau].repeat_interleave(group)  # [H]
            out[t] += coef * x[t - tau]
    return out


def _conv_sublayer(sublayer, x: torch.Tensor, w: dict, name: str, dflash: dict) -> torch.Tensor:
    """sublayer(x) as DFlash 2 wraps it: the input-side convolution, the sublayer, the output side, both
    sides' dynamic kernels from the normed input x; plain sublayer(x) where the layer has no `name`."""
    if name + ".base_kernel" not in w:
        return sublayer(x)
    base = w[name + ".base_kernel"].float()  # [2, K, H]
    taps, group = base.shape[1], int(dflash["conv_group_size"])
    dyn = F.linear(x, w[name + ".kernel_projection.weight"].float())  # [B, 2*K*H/G]: side, tap, group
    dyn = dyn.view(x.shape[0], 2, taps, x.shape[1] // group)
    y = _convolve(x, base[0], dyn[:, 0], group)
    return _convolve(sublayer(y), base[1], dyn[:, 1], group)


def engine_scaling(hf, dflash: dict) -> tuple[float, float, float | None]:
    """(input_embedding_scale, output_multiplier, final_logit_softcapping) as z-lab's reference `dflash`
    reads them: `dflash_config` first, then the top-level attribute, else the identity; a cap <= 0 is none."""
    def value(name, default):
        return dflash.get(name, getattr(hf, name, default))

    cap = value("final_logit_softcapping", None)
    return (float(value("input_embedding_scale", 1.0)), float(value("output_multiplier", 1.0)),
            float(cap) if cap is not None and float(cap) > 0 else None)


def engine_block_embeds(rows: torch.Tensor, hf, dflash: dict) -> torch.Tensor:
    """The block's embedding-table rows [B, H] as the drafter receives them."""
    return rows.float() * engine_scaling(hf, dflash)[0]


def engine_logits(hidden: torch.Tensor, lm_head: torch.Tensor, hf, dflash: dict) -> torch.Tensor:
    """Draft logits [B, V] of the drafter's final hidden states [B, H] through the target's lm_head [V, H]."""
    _, multiplier, cap = engine_scaling(hf, dflash)
    logits = F.linear(hidden.float(), lm_head.float()) * multiplier
    return torch.tanh(logits / cap) * cap if cap is not None else logits


def engine_draft_logits(hidden: torch.Tensor, lm_head: torch.Tensor, d2t: torch.Tensor, vocab_size: int, hf,
                        dflash: dict) -> torch.Tensor:
    """Draft logits [B, vocab_size] of a reduced draft vocabulary as vLLM computes them: the drafter's own lm_head
    [n, H], then each draft id's logit scattered to token draft id + d2t[draft id], -inf elsewhere
    (vllm/model_executor/models/qwen3_dflash.py DFlashQwen3ForCausalLM.compute_logits)."""
    draft = engine_logits(hidden, lm_head, hf, dflash)  # [B, n]
    targets = torch.arange(d2t.numel()) + d2t.long()
    out = draft.new_full((draft.shape[0], vocab_size), float("-inf"))
    out[:, targets] = draft
    return out


def engine_forward(hf, dflash: dict, w: dict[str, torch.Tensor], context_taps: torch.Tensor,
                   block_embeds: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states [B, H] of one block after C context positions, in float32.

    hf: `engine_config`; w: `engine_weights`; context_taps [C, K*H]; block_embeds [B, H]."""
    eps = hf.rms_norm_eps
    ctx = _rms(_linear(context_taps.float(), w, "fc"), w["hidden_norm.weight"], eps)  # [C, H]
    x = block_embeds.float()
    inner = hf.intermediate_size
    for i in range(hf.num_hidden_layers):
        p = f"layers.{i}."
        visible = _visible(hf, dflash, i, ctx.shape[0], x.shape[0])
        attend = lambda h: _attention(hf, w, p, h, ctx, visible)  # noqa: E731 - the sublayer the conv wraps
        x = x + _conv_sublayer(attend, _rms(x, w[p + "input_layernorm.weight"], eps), w, p + "attention_conv", dflash)
        gate, up = w[p + "mlp.gate_up_proj.weight"].float().split([inner, inner])
        mlp = lambda h: _linear(F.silu(F.linear(h, gate)) * F.linear(h, up), w, p + "mlp.down_proj")  # noqa: E731
        x = x + _conv_sublayer(mlp, _rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp_conv", dflash)
    return _rms(x, w["norm.weight"], eps)
