"""The drafter's backbone fields: what the DFlash layers, the block and the target's scaling read.

`DrafterConfig` (model/drafter/config.py) is this plus every head's settings (model/drafter/heads/architectures.py) and the
checks; the modules (model/drafter/backbone.py and the head files) are typed against this base, so they never
import the config that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_train.model.target.scaling import Scaling

BASE_HEAD = "dflash"
"""The paper's head (model/drafter/backbone.py), every other head's base: the one default of `drafter.arch`."""


@dataclass(frozen=True, kw_only=True)
class DrafterShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """Rows of the target's embedding table (the mask token must be one of them)."""
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    """z-lab semantics: output of target decoder layer i (HF hidden_states[i + 1])."""
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = ()
    """Per layer: full_attention or sliding_attention. Empty means all full attention."""
    sliding_window: int | None = None
    window_causal: bool = True
    """Sliding-window layers causal inside the block (z-lab's reading of a config without `is_causal`);
    False = the 2026 drafters' non-causal window (`is_causal: false`): the block stays bidirectional."""
    attention_bias: bool = False
    arch: str = BASE_HEAD
    """The drafter's head (model/drafter/heads/architectures.py lists them; each head file declares its settings)."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    input_embedding_scale: float = 1.0
    """The target's embedding scale (Gemma: sqrt(hidden_size)): block embeddings are table rows times it."""
    output_multiplier: float = 1.0
    """The target's logit multiplier: logits = lm_head(h) * output_multiplier (model/target/scaling.py)."""
    final_logit_softcapping: float | None = None
    """The target's logit soft cap c: logits = c * tanh(logits / c); None: no cap."""
    extra: dict = field(default_factory=dict, compare=False)
    """Optional z-lab keys read from a published checkpoint, carried through unchanged."""

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def scaling(self) -> Scaling:
        return Scaling(self.input_embedding_scale, self.output_multiplier, self.final_logit_softcapping)
