"""How a target scales its input embeddings and its logits, which a drafter must copy.

A DFlash drafter sees rows of the target's embedding table (the block `[anchor, MASK...]`) and is scored
by the target's lm_head. Some targets scale one or both: Gemma multiplies its embeddings by
sqrt(hidden_size); Gemma 2 and 4 soft-cap their logits at 30; Granite scales embeddings by
`embedding_multiplier` and divides logits by `logits_scaling`; Cohere multiplies logits by `logit_scale`.
The z-lab format says so in three optional `dflash_config` keys, read as z-lab's reference `dflash`
package (0.1.0, `model.py`) reads them, each absent key meaning the identity:

    embeds = embed_tokens.weight[ids] * input_embedding_scale
    logits = lm_head(h) * output_multiplier
    logits = c * tanh(logits / c)            where c = final_logit_softcapping is set and > 0

`target_scaling` derives them from the target's config (rules per architecture family, because the same
attribute name means different things across families: Granite divides by `logits_scaling`, HyperCLOVA X
multiplies); `model/target/target.py Target.scaling_problems` then checks them against the loaded target's own
forward, so a rule that is wrong, or a target that does something else, is refused with its field named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FIELDS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")


@dataclass(frozen=True)
class Scaling:
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}

    def non_identity(self) -> dict:
        """The fields that differ from the identity, as `dflash_config` writes them."""
        out = {}
        if self.input_embedding_scale != 1.0:
            out["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            out["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            out["final_logit_softcapping"] = self.final_logit_softcapping
        return out


def scaling_problems(values: dict) -> list[tuple[str, str]]:
    """(field, why) for each value no engine can express: the multipliers must be finite and positive
    (a negative one flips the draft's argmax; vLLM and SGLang reject <= 0), the cap finite and positive
    or unset."""
    out = []
    for name in ("input_embedding_scale", "output_multiplier"):
        value = values.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            out.append((name, f"{value!r} is not a finite number > 0"))
    cap = values.get("final_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                            or not math.isfinite(cap) or cap <= 0):
        out.append(("final_logit_softcapping", f"{cap!r} is not a finite number > 0 (or unset)"))
    return out


def _get(cfg, key: str, default=None):
    """An attribute of an HF config object, or a key of its config.json dict."""
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _family(model_type: str) -> str:
    for prefix in ("gemma", "vaultgemma", "granite", "minicpm3", "hyperclovax", "falcon_h1", "cohere"):
        if model_type.startswith(prefix):
            return prefix
    return model_type


def _number(cfg, key: str, default: float = 1.0) -> float:
    value = _get(cfg, key, default)
    return float(default if value is None else value)


def target_scaling(text_cfg) -> Scaling:
    """The scaling of a target's text config (an HF config or its config.json dict), by family:
    the Gemma family scales embeddings by sqrt(hidden_size) (their `*ScaledWordEmbedding`); Granite and
    MiniCPM3 divide logits by `logits_scaling`, HyperCLOVA X multiplies by it; Granite, HyperCLOVA X and
    Falcon-H1 scale embeddings by `embedding_multiplier`, MiniCPM3 by `scale_emb`; Falcon-H1 multiplies
    logits by `lm_head_multiplier`, Cohere by `logit_scale`; any target may set `final_logit_softcapping`."""
    family = _family(str(_get(text_cfg, "model_type", "") or ""))
    embed, out = 1.0, 1.0
    if family in ("gemma", "vaultgemma"):
        embed = float(_get(text_cfg, "hidden_size")) ** 0.5
    elif family in ("granite", "hyperclovax", "falcon_h1"):
        embed = _number(text_cfg, "embedding_multiplier")
    elif family == "minicpm3":
        embed = _number(text_cfg, "scale_emb")
    if family in ("granite", "minicpm3"):
        scaling = _number(text_cfg, "logits_scaling")
        out = 1.0 / scaling if scaling else math.inf
    elif family == "hyperclovax":
        out = _number(text_cfg, "logits_scaling")
    elif family == "falcon_h1":
        out = _number(text_cfg, "lm_head_multiplier")
    elif family == "cohere":
        out = _number(text_cfg, "logit_scale")
    cap = _get(text_cfg, "final_logit_softcapping")
    return Scaling(embed, out, float(cap) if cap else None)


def scale_embeddings(embeds: torch.Tensor, scale: float) -> torch.Tensor:
    """Block embeddings as the drafter sees them: the table's rows times `input_embedding_scale`."""
    return embeds if scale == 1.0 else embeds * scale


def scale_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """lm_head scores as the target turns them into logits: times `output_multiplier`, then soft-capped.
    Apply before masking rows out with -inf (tanh would turn -inf into -softcap)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits
