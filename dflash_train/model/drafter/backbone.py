"""The DFlash drafter as pure math: no distributed code, no I/O, no target weights inside.

`DFlashDrafter` is also the interface every head implements (model/drafter/heads/architectures.py picks the class
by `DrafterConfig.arch`; each other head subclasses it in its own file): which block slots draft
(`drafted_offset`, `drafted`), a logit bias on the tokens drafted before (`logit_bias`), a term of its
own in the loss (`extra_loss`), the greedy choice given the previous tokens (`greedy`) and the
drafting walk (`propose`). The training loop, the sources and checkpoints never ask which head trains.
This file is the plain DFlash head too: its declaration, `HEAD`, is at the end.

Module tree and parameter names are those of z-lab `DFlashDraftModel` (spec 1.1), so a state dict
saves and loads as the published checkpoint format: `layers.{i}.*`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`. The target's embedding and lm_head are used from outside
(frozen, shared) and never stored here.

KV injection (paper A.3): the fused target context `ctx = hidden_norm(fc(concat(taps)))` is
projected by every layer's k_proj/v_proj (k_norm and RoPE applied to it as to the block keys) and
prepended to the block's keys and values. Queries come from the block tokens only; the context
bypasses input_layernorm, the MLP and o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash_train.model.drafter.attention import SLIDING, attend, inference_mask
from dflash_train.model.drafter.shape import BASE_HEAD, DrafterShape
from dflash_train.model.drafter.head import SGLANG, VLLM, Engine, Export, Foreign, Head, ReducedVocab


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in float32, cast back, scale (in that order, as HF and the engines' kernels do).

    The normalisation is `F.rms_norm` (weightless, float32): the same formula as the spelled-out
    x * rsqrt(mean(x^2) + eps), bit for bit on the CPU (where torch runs it as those ops), and where torch has a
    fused kernel for it (CUDA) one launch instead of five. The eval's CUDA-graph cycle is bound by its kernel
    count (docs/PERF.md 3.8.3), and a drafter's forward runs 4 norms per layer plus its final and context norms."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [b, L, head_dim] for absolute positions [b, L] (neox layout: halves, not pairs)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[..., None] * inv_freq  # [b, L, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [b, L, hd]
    return emb.cos(), emb.sin()


def rope_in(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin cast once to x's dtype where every layer's queries and keys are in it (no autocast: the
    layers' outputs keep their input's dtype), so `apply_rope` casts nothing: two casts per forward instead
    of four per layer, the same values (issue 37: a bf16 eval cycle ran 36 of these casts). Under autocast
    they stay float32 and `apply_rope` casts them to each tensor's own dtype, as before."""
    cos, sin = cos_sin
    if torch.is_autocast_enabled(x.device.type):
        return cos, sin
    return cos.to(x.dtype), sin.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, L, hd]; cos/sin [b, L, hd]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterShape):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(h, cfg.num_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, n, self.head_dim).transpose(1, 2)  # [b, n, L, hd]

    def project_kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm + RoPE) and values [b, Hkv, L, hd] of x [b, L, H] at the given positions."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, h: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor], cos, sin, mask,
                backend: str) -> torch.Tensor:
        """h [b, Q, H] block tokens (normed); ctx_kv: context keys/values [b, Hkv, C, hd]."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(h), self.num_heads)), cos, sin)
        k_blk, v_blk = self.project_kv(h, cos, sin)
        k = torch.cat([ctx_kv[0], k_blk], dim=2)  # [b, Hkv, C + Q, hd]
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        out = attend(q, k, v, mask, backend)  # [b, Hq, Q, hd]
        b, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))  # [b, Q, Hq*hd] -> [b, Q, H]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterShape, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, ctx_kv, cos, sin, mask, backend: str, block_size: int | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, cos, sin, mask, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class LossTerms:
    """What a head's own loss term (`extra_loss`) may read besides its rows' results."""

    progress: float = 1.0
    """Share of the training schedule done before this step, in [0, 1] (1 outside training)."""
    unbiased: Callable[[], object] | None = None
    """The rows' results without the head's logit bias (`softmax_rows.RowsOut`, its weighted `loss_sum`
    with a gradient; one more lm_head pass)."""


class DFlashDrafter(nn.Module):
    """Trainable parts of a DFlash drafter: layers, fc, hidden_norm, norm; and the plain DFlash head:
    slots 1..B-1 draft, each the argmax of the target's lm_head (sampled independently at T > 0).

    Rows and previous tokens reach the head methods in blocks: rows [M, D, H] and prev [M, D] (M blocks
    of D drafted tokens, prev[:, 0] the anchor); a flat [T, H] / [T] is T blocks of one row each (a
    head whose bias runs along the block needs the blocks). `embed(ids)` gives the target's input
    embeddings of token ids, scaled as the block's are (for heads that read the drafted tokens)."""

    drafted_offset = 1
    """The first block slot that drafts a token: 1 (slot 0 holds the anchor, DFlash), 0 when the
    anchor's slot drafts too (DSpark, Domino). Drafted token i comes from slot drafted_offset + i and
    is token anchor + i + 1."""

    candidates_per_row = 0
    """Top-k of each row's logits the loss reports for the head's own term (DFlash 2's selector)."""

    backbone_prefixes = ("layers.", "fc")
    """Modules the compiled forward runs (the rest, a head's own modules, runs in the eager loss)."""

    def __init__(self, cfg: DrafterShape):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(self.make_layer(cfg, t) for t in cfg.layer_types)
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def make_layer(cfg: DrafterShape, layer_type: str) -> nn.Module:
        return DFlashDecoderLayer(cfg, layer_type)

    @classmethod
    def drafted(cls, block_size: int) -> int:
        """Tokens one block drafts (D): the slots from `drafted_offset` to the block's end."""
        return block_size - cls.drafted_offset

    def drafted_rows(self, hidden: torch.Tensor, block_size: int) -> torch.Tensor:
        """The drafting slots' hidden states: [b, N*B, H] -> [b, N, D, H]."""
        return drafted_rows(hidden, block_size, self.drafted_offset, self.drafted(block_size))

    def logit_bias(self, prev: torch.Tensor, vocab_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   embed=None):
        """A trainable low-rank logit bias e @ M.T for previous tokens prev [M, D] with their rows
        [M, D, H] (or flat [T] / [T, H]; a head that reads no rows takes none): (e [M*D, r], M [V', r])
        added to the raw logits before the target's scaling, or None (DFlash). vocab_ids [V'] restrict
        M's rows to a training vocabulary."""
        return None

    def extra_loss(self, rows: torch.Tensor, out, labels: torch.Tensor, prev: torch.Tensor | None,
                   vocab_ids: torch.Tensor | None, weight: float, has_tv: bool, terms: LossTerms | None = None):
        """The head's own loss term, per row [T] (weighted like the rows' loss) or already summed over
        the rows ([]), and its greedy choice [T] when it differs from the argmax of the logits; (None,
        None) for DFlash. rows [T, H] and prev [T] flat; `out` is `softmax_rows.RowsOut` of the rows;
        labels in the lm_head's row space (`vocab_ids`)."""
        return None, None

    def acceptance_logits(self, rows: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Logits [T] of each drafted token's acceptance, from flat rows [T, H] and the tokens before them prev
        [T] (a head's confidence, which engines may read to stop a draft), or None: DFlash has no such head."""
        return None

    def greedy(self, rows: torch.Tensor, prev: torch.Tensor, logits_fn, embed=None) -> torch.Tensor:
        """The greedy drafts [M, D] of rows [M, D, H] given the previous tokens prev [M, D] (teacher
        forced: on a leading run of accepted drafts the previous tokens are the data's), or [T] of flat
        rows [T, H]. logits_fn(rows [n, H], bias=None) -> [n, V]."""
        return logits_fn(rows.reshape(-1, rows.shape[-1])).argmax(-1).view(rows.shape[:-1])

    def propose(self, rows: torch.Tensor, anchor: "int | torch.Tensor", logits_fn, temperature: float, generator=None,
                embed=None):
        """Draft one block from its drafting rows [D, H] after `anchor`: (tokens [D], q [D, V] the
        distribution each token was drawn from, None when greedy)."""
        return draw(logits_fn(rows), temperature, generator)  # logits [D, V]

    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """HF-style init: normal(0, std) linears, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[b, C, K*H] concatenated taps -> [b, C, H] context shared by every layer."""
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values [b, Hkv, C, hd] for fused context at absolute positions."""
        cos, sin = rope_in(ctx, rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta))
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def run_layers(self, x: torch.Tensor, ctx_kv: list, block_positions: torch.Tensor, masks: dict,
                   backend: str, block_size: int) -> torch.Tensor:
        """Block tokens x [b, Q, H] (Q a multiple of block_size) at absolute positions [b, Q] through all
        layers; returns norm(x)."""
        cos, sin = rope_in(x, rope_cos_sin(block_positions, self.config.head_dim, self.config.rope_theta))
        for layer, kv in zip(self.layers, ctx_kv):
            mask = masks.get(layer.layer_type) if masks else None
            x = layer(x, kv, cos, sin, mask, backend, block_size)
        return self.norm(x)

    def forward(self, block_embeds: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                masks: dict, backend: str) -> torch.Tensor:
        """Training forward.

        block_embeds  [b, N*B, H]     target embedding of [anchor, MASK x (B-1)] per block
        target_hidden [b, S, K*H]     taps of the clean sequence
        position_ids  [b, S + N*B]    [arange(S) ; anchor + arange(B) per block]
        masks         {layer_type: mask} from `attention.build_training_masks`
        returns       [b, N*B, H]     final-normed hidden states, for the target lm_head
        """
        context_len = target_hidden.shape[1]
        ctx = self.fuse_context(target_hidden)
        ctx_kv = self.context_kv(ctx, position_ids[:, :context_len])
        return self.run_layers(block_embeds, ctx_kv, position_ids[:, context_len:], masks, backend,
                               self.config.block_size)

    def draft(self, block_embeds: torch.Tensor, cache: "ContextCache", block_positions: torch.Tensor,
              backend: str = "sdpa") -> torch.Tensor:
        """Inference forward of one block [b, B, H] after the cached context (spec 1.6).

        The anchor sits at position `cache.length`; full-attention layers need no mask (the block
        sees all cached context and itself, bidirectionally), sliding-window layers get the windowed
        (and, for `window_causal` drafters, causal) mask of `attention.inference_mask`.
        """
        masks = {}
        if SLIDING in self.config.layer_types:
            masks[SLIDING] = inference_mask(cache.length, block_embeds.shape[1], self.config.sliding_window,
                                            block_embeds.device, causal=self.config.window_causal)
        return self.run_layers(block_embeds, cache.kv, block_positions, masks, backend, block_embeds.shape[1])


def anchor_ids(anchor, device) -> torch.Tensor:
    """The anchor as ids [1] on `device`: a Python int, or a device tensor (the fixed-shape eval decoder
    keeps it on the device, where a CUDA graph reads it at every replay)."""
    if isinstance(anchor, torch.Tensor):
        return anchor.reshape(1).to(device)
    return torch.tensor([anchor], device=device)


def slot_logits(logits_fn, rows: torch.Tensor):
    """`at(i, bias=None)` -> logits [1, V] of row i of a block's rows [D, H], for a head that drafts slot by
    slot. A logits function with `scores` and `logits` halves (the eval's `DraftHead`) has every row's
    lm_head scores computed here in one matmul, one read of the lm_head per block instead of one per slot
    (issue 37); the bias and the scaling are applied per slot as in a whole call. Any other callable is
    called per row."""
    if hasattr(logits_fn, "scores") and hasattr(logits_fn, "logits"):
        scores = logits_fn.scores(rows)  # [D, V']
        return lambda i, bias=None: logits_fn.logits(scores[i:i + 1], bias)
    return lambda i, bias=None: logits_fn(rows[i:i + 1], bias=bias)


def drafted_rows(hidden: torch.Tensor, block_size: int, offset: int = 1, count: int | None = None) -> torch.Tensor:
    """[b, N*B, H] block outputs -> [b, N, D, H], the D = `count` slots from `offset` on (default: to
    the block's end)."""
    b, q, h = hidden.shape
    count = block_size - offset if count is None else count
    return hidden.view(b, q // block_size, block_size, h)[:, :, offset:offset + count]  # [b, N, D, H]


def as_blocks(rows: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, D, H] and prev [M, D] as they are; flat rows [T, H] and prev [T] as T blocks of one row."""
    return (rows, prev) if prev.dim() == 2 else (rows.reshape(-1, 1, rows.shape[-1]), prev.reshape(-1, 1))


class ContextCache:
    """Per-layer context keys/values [b, Hkv, n, hd] of every verified position, in order.

    Only context enters the cache: block keys/values are recomputed each draft step, so after a
    partial acceptance nothing needs cropping (z-lab crops its cache back to `start` for the same
    effect). `length` is the number of cached positions, which is also the next anchor position.
    """

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0

    def append(self, drafter: DFlashDrafter, target_hidden: torch.Tensor) -> None:
        """Add the taps [b, n, K*H] of the next n verified positions."""
        n = target_hidden.shape[1]
        positions = torch.arange(self.length, self.length + n, device=target_hidden.device)[None]
        positions = positions.expand(target_hidden.shape[0], n)  # [b, n]
        new = drafter.context_kv(drafter.fuse_context(target_hidden), positions)
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2))
                       for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.length += n


HEAD = Head(
    name=BASE_HEAD, module=DFlashDrafter, published_block=16,  # the paper's block
    # A draft vocabulary is exported in vLLM's reduced form: DFlashQwen3ForCausalLM builds its lm_head with
    # draft_vocab_size rows, loads `d2t` as draft_id_to_target_id and scatters the logits back to vocab_size
    # (vllm/model_executor/models/qwen3_dflash.py __init__ / load_weights / compute_logits). SGLang's
    # DFlashDraftModel.load_weights skips names it has no parameter for (python/sglang/srt/models/dflash.py) and
    # drafts over the target's lm_head: the whole vocabulary, as before.
    export=Export(("DFlashDraftModel",), speculators_type="dflash",
                  reduced_vocab=ReducedVocab(served_by=(VLLM,), ignored_by=(SGLANG,))),
    engines=(Engine(VLLM, "dflash"), Engine(SGLANG, "DFLASH", extra_tokens=1)),
    foreign=Foreign(speculators_type="dflash"),
)


def draw(logits: torch.Tensor, temperature: float, generator=None):
    """Tokens [n] drawn from logits [n, V] (argmax when greedy), and q [n, V] the distribution each was drawn
    from (None when greedy). One rule for every head's drafting, slot by slot or all at once."""
    if temperature <= 0:
        return logits.argmax(-1), None
    q = torch.softmax(logits.double() / temperature, dim=-1)
    return torch.multinomial(q, 1, generator=generator).squeeze(-1), q
