"""The drafter's own configuration, derived from the target's, and validated.

It carries exactly what the z-lab checkpoint format stores (spec 3.1). It never inherits
`partial_rotary_factor`, `rope_scaling` or M-RoPE sections from the target: the drafter always
rotates the full head with plain 1-D RoPE, and a copied partial factor makes vLLM rotate a
quarter of the head at inference and collapses acceptance (spec 1.7).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dflash_train.model.drafter.heads.architectures import SETTINGS, head, others_at_defaults, setting_problems
from dflash_train.model.drafter.attention import FULL, SLIDING
from dflash_train.model.drafter.shape import BASE_HEAD, DrafterShape
from dflash_train.model.target.scaling import Scaling, scaling_problems, target_scaling
from dflash_train.model.target.taps import build_target_layer_ids


@dataclass(frozen=True, kw_only=True)
class DrafterConfig(*reversed(SETTINGS), DrafterShape):
    """The backbone's fields (`DrafterShape`) and every head's settings (each head file's settings
    dataclass; those of a head other than `arch` keep their defaults), validated on construction."""

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if SLIDING not in self.layer_types:  # meaningless without a sliding layer: one value, so configs compare equal
            object.__setattr__(self, "window_causal", True)
        for name, default in others_at_defaults(self.arch).items():  # another head's settings: likewise
            object.__setattr__(self, name, default)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field for any setting that cannot work."""
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor + at least one drafted slot), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target embedding table "
                             f"[0, {self.vocab_size}); pick a reserved id, never resize the embedding")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: at least one target layer must be tapped")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)}: {bad} out of range for a target "
                             f"with {self.num_target_layers} layers (z-lab ids are 0-based decoder layers)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ValueError(f"layer_types: unknown {sorted(unknown)}; expected {FULL} or {SLIDING}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        head(self.arch)  # a ValueError listing the heads
        for problem in setting_problems(self, self.hidden_size, only=self.arch):
            raise ValueError(problem)
        if SLIDING in self.layer_types and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window {self.sliding_window} is smaller than block_size {self.block_size}: "
                             "a block's own slots would fall out of each other's window")
        for name, why in scaling_problems(self.scaling.as_dict()):
            raise ValueError(f"{name}: {why}")

    def check_target(self, target_hidden_size: int, target_num_layers: int, target_vocab_size: int) -> None:
        """The drafter must match the target it drafts for: width, depth, embedding rows, and taps
        the engines capture the same way (never the last layer)."""
        last_tap = last_layer_tap_problem(self.target_layer_ids, target_num_layers)
        if last_tap:
            raise ValueError(last_tap)
        if self.hidden_size != target_hidden_size:
            raise ValueError(f"hidden_size {self.hidden_size} differs from the target's {target_hidden_size}: "
                             "the drafter shares the target's embedding and lm_head, so widths must match")
        if self.num_target_layers != target_num_layers:
            raise ValueError(f"num_target_layers {self.num_target_layers} differs from the target's {target_num_layers}")
        if self.vocab_size != target_vocab_size:
            raise ValueError(f"vocab_size {self.vocab_size} differs from the target embedding rows {target_vocab_size}")


def last_layer_tap_problem(target_layer_ids, num_target_layers: int) -> str | None:
    """Why a tap of the target's last decoder layer cannot be served, or None when there is none.

    The three runtimes disagree on that one tensor: our trainer takes HF `hidden_states[L]`, which
    is after the target's final norm; vLLM captures the layer's output before the norm; SGLang
    never captures it. A drafter trained on it is silently fed other inputs at serve time.
    """
    last = num_target_layers - 1
    if last not in set(int(i) for i in target_layer_ids):
        return None
    return (f"target_layer_ids {list(target_layer_ids)} taps the target's last layer {last}: our trainer "
            "takes it after the target's final norm, vLLM before that norm, and SGLang never captures it, "
            f"so the served drafter would see other inputs than in training; use ids in [0, {last - 1}]")


def _text_config(target_config):
    """Multimodal configs keep the language model's settings in `text_config`."""
    return getattr(target_config, "text_config", None) or target_config


def rope_theta_of(cfg) -> float:
    """rope_theta of an HF config: `rope_parameters` (transformers 5) or the older attribute. Targets with
    RoPE per layer type (Gemma 3: local 1e4, global 1e6) give their full-attention one, the long-range
    setting the drafter's full layers need."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):
        params = params[FULL]
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0) or 10000.0)


MAX_ENGINE_HEAD_DIM = 256
"""FlashAttention's largest head size; vLLM serves DFlash drafters only on its flash_attn backend."""


def check_servable(cfg, head_dim: int) -> Scaling:
    """Refuse targets whose drafter the engines (vLLM, SGLang, spec 3.1/3.3) could not run as trained: a
    head size FlashAttention lacks (> 256), or a scaling of embeddings or logits that the z-lab fields
    cannot express (model/target/scaling.py; each named). Returns the target's scaling, which the drafter copies."""
    name = getattr(cfg, "model_type", "target")
    if head_dim > MAX_ENGINE_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {head_dim} cannot be served: the engines' FlashAttention backend "
                         f"takes at most {MAX_ENGINE_HEAD_DIM}")
    scaling = target_scaling(cfg)
    for field_name, why in scaling_problems(scaling.as_dict()):
        raise ValueError(f"{name}: its {field_name.replace('_', ' ')} is {why}: dflash_config.{field_name} "
                         "cannot express it for any engine")
    return scaling


def _intermediate_size(cfg) -> int:
    """A dense target's MLP width; for MoE targets (whose per-expert width is small) 3 x hidden."""
    is_moe = any(getattr(cfg, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if is_moe or not getattr(cfg, "intermediate_size", None):
        return 3 * cfg.hidden_size
    return int(cfg.intermediate_size)


def tap_layer_ids(n_target: int, num_taps: int, explicit=None) -> list[int]:
    """The tapped layers (z-lab ids) a drafter of `num_taps` taps reads, or `explicit`, checked as the
    engines need them: strictly increasing (each layer is captured once) and not the last layer.
    Training and `dflash-train prepare` both take their ids from here, so shards always match."""
    ids = list(explicit) if explicit is not None else build_target_layer_ids(n_target, num_taps)
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"target_layer_ids {ids} are not strictly increasing (the engines capture each layer "
                         f"once): a target of {n_target} layers has {max(n_target - 3, 1)} distinct z-lab taps "
                         "in [1, L-3]; lower drafter.num_taps or set target.layer_ids")
    last_tap = last_layer_tap_problem(ids, n_target)
    if last_tap:
        raise ValueError(last_tap)
    return ids


WINDOW_LAYERS = ("all", "all_but_last")


def drafter_config_from_target(target_config, *, num_layers: int, block_size: int, mask_token_id: int,
                               target_layer_ids=None, num_taps: int = 5, sliding_window: int | None = None,
                               window_layers: str = "all", window_causal: bool = False,
                               vocab_size: int | None = None, arch: str = BASE_HEAD,
                               head_settings: dict | None = None) -> DrafterConfig:
    """Derive the drafter from the target: width, heads, head_dim, rope theta, eps, vocab, taps, and how
    the target scales its embeddings and logits (model/target/scaling.py); `head_settings` the heads' own
    (`drafter.*` fields of model/drafter/heads/architectures.py's heads; absent ones take their defaults).

    With `sliding_window`, every layer is sliding_attention (`window_layers="all"`, the 2026
    drafters) or all but the last (`"all_but_last"`, the published Qwen3.6-27B drafter);
    `window_causal` makes those layers causal inside the block (z-lab's older drafters).
    """
    cfg = _text_config(target_config)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    scaling = check_servable(cfg, head_dim)
    ids = tap_layer_ids(cfg.num_hidden_layers, num_taps, target_layer_ids)
    if window_layers not in WINDOW_LAYERS:
        raise ValueError(f"window_layers={window_layers!r}: expected one of {', '.join(WINDOW_LAYERS)}")
    types = (FULL,) * num_layers
    if sliding_window:
        types = (SLIDING,) * num_layers if window_layers == "all" else (SLIDING,) * (num_layers - 1) + (FULL,)
    return DrafterConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=_intermediate_size(cfg),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=vocab_size or cfg.vocab_size,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(ids),
        num_target_layers=cfg.num_hidden_layers,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(cfg),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
        layer_types=types,
        sliding_window=sliding_window,
        window_causal=window_causal,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        arch=arch,
        **(head_settings or {}),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_id=getattr(cfg, "eos_token_id", None),
        **scaling.as_dict(),
    )


def with_block_size(cfg: DrafterConfig, block_size: int) -> DrafterConfig:
    return replace(cfg, block_size=block_size)
