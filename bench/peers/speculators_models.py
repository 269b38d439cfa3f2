"""The three speculators 0.9.0 DFlash-family drafters the peer step harness times.

``--model dflash | dflash2 | dspark`` picks the class (``DFlashDraftModel``,
``DFlash2DraftModel``, ``DSparkDraftModel``). Each model is built by its own
``from_training_args``. Only ``load_verifier_weights`` is skipped: it reads the
verifier's safetensors, and the harness fills those frozen weights with random
values instead. The trainer kwargs come from the class's own ``get_trainer_kwargs``.

Recipe defaults per model
-------------------------
These apply only to flags the user left unset.

* **dflash**: the shared harness's DFlash-paper shape: block 16, CE, fixed decay
  gamma 7, full attention in every layer. Unchanged, so old runs stay comparable.
* **dflash2** and **dspark**: speculators' own CLI recipe (``train/config/schema.py``,
  ``TrainConfig._resolve_derived_defaults``): block 8, ``kl_div``, fixed decay gamma 4,
  every draft layer sliding-window 2048.
  - dflash2 uses a non-causal window (``sliding_window_non_causal``), anchor-bonus layout.
  - dspark uses a causal window and ``sample_from_anchor`` (drafts B tokens).
  - Heads are speculators' defaults: dflash2 conv K2/G16, selector r256/k16,
    selector alpha 1.0; dspark vanilla Markov r256, confidence head with Markov
    input, confidence alpha 1.0.
"""

from __future__ import annotations

import argparse
from unittest import mock

MODELS = ("dflash", "dflash2", "dspark")

# Values for the flags whose default depends on --model (argparse default None).
RECIPES = {
    "dflash": dict(block=16, loss="ce", gamma=7.0, attn="full"),
    "dflash2": dict(block=8, loss="kl_div", gamma=4.0, attn="sliding"),
    "dspark": dict(block=8, loss="kl_div", gamma=4.0, attn="sliding"),
}


def add_arguments(p):
    """Model choice plus the DFlash2 / DSpark head flags (defaults = speculators')."""
    p.add_argument("--model", choices=MODELS, default="dflash",
                   help="speculators draft model to time (recipe defaults per model, see --help-recipes)")
    p.add_argument("--help-recipes", action="store_true", help="print the per-model defaults and exit")
    p.add_argument("--non-causal", action=argparse.BooleanOptionalAction, default=None,
                   help="sliding_window_non_causal (default: speculators' per-model value, True for dflash2)")
    p.add_argument("--sample-from-anchor", action=argparse.BooleanOptionalAction, default=None,
                   help="sample_from_anchor (default: speculators' per-model value, True for dspark)")
    g = p.add_argument_group("dflash2 heads")
    g.add_argument("--conv-kernel", type=int, default=2, help="conv_kernel_size")
    g.add_argument("--conv-group", type=int, default=16, help="conv_group_size")
    g.add_argument("--selector-rank", type=int, default=256)
    g.add_argument("--selector-top-k", type=int, default=16)
    g.add_argument("--selector-alpha", type=float, default=1.0, help="selector_loss_alpha")
    g = p.add_argument_group("dspark heads")
    g.add_argument("--markov-rank", type=int, default=256)
    g.add_argument("--markov-head-type", choices=["vanilla", "gated", "rnn"], default="vanilla")
    g.add_argument("--confidence", action=argparse.BooleanOptionalAction, default=True,
                   help="enable_confidence_head")
    g.add_argument("--confidence-with-markov", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--confidence-alpha", type=float, default=1.0, help="confidence_head_alpha")


def apply_recipe(a):
    """Fill the --model dependent defaults that the user left unset (None)."""
    for key, value in RECIPES[a.model].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.weighting == "dpace" and a.loss != "ce":
        # speculators' TrainConfig._validate_dpace enforces the same rule.
        raise SystemExit("--weighting dpace requires --loss ce (speculators' rule)")


def model_class(name: str):
    if name == "dflash":
        from speculators.models.dflash import DFlashDraftModel as cls
    elif name == "dflash2":
        from speculators.models.dflash2 import DFlash2DraftModel as cls
    else:
        from speculators.models.dspark import DSparkDraftModel as cls
    return cls


def training_args(a, verifier_dir: str) -> dict:
    """The kwargs speculators' trainer passes to from_training_args (train/cli flatten)."""
    kw = dict(
        verifier_name_or_path=verifier_dir,
        target_layer_ids=a.target_layer_ids,
        draft_vocab_size=a.vocab,
        block_size=a.block,
        mask_token_id=a.mask_token_id,
        draft_attn_impl=a.attn_impl,
    )
    if a.non_causal is not None:
        kw["sliding_window_non_causal"] = a.non_causal
    if a.sample_from_anchor is not None:
        kw["sample_from_anchor"] = a.sample_from_anchor
    if a.model == "dflash2":
        kw.update(conv_kernel_size=a.conv_kernel, conv_group_size=a.conv_group,
                  selector_rank=a.selector_rank, selector_top_k=a.selector_top_k)
    elif a.model == "dspark":
        kw.update(markov_rank=a.markov_rank, markov_head_type=a.markov_head_type,
                  enable_confidence_head=a.confidence,
                  confidence_head_with_markov=a.confidence_with_markov)
    return kw


def build(a, tl_config, verifier_dir: str, device, log):
    """Run cls.from_training_args, built in place on `device` when possible."""
    import torch

    cls = model_class(a.model)
    kw = training_args(a, verifier_dir)
    # from_training_args ends with load_verifier_weights(), which reads the
    # verifier's safetensors; the caller fills those frozen tensors instead.
    no_verifier = mock.patch.object(cls, "load_verifier_weights", lambda self: None)
    try:
        with no_verifier, torch.device(device):
            return cls.from_training_args(tl_config, **kw)
    except Exception as e:  # noqa: BLE001
        log(f"# building on {device} failed ({type(e).__name__}: {e}); building on cpu")
        with no_verifier:
            return cls.from_training_args(tl_config, **kw)


def trainer_kwargs(a, loss_impl: str) -> dict:
    """The class's own get_trainer_kwargs (loss config, decay, anchors, head alphas)."""
    kw = dict(
        loss_fn=a.loss,
        loss_implementation=loss_impl,
        dflash_decay_gamma=a.gamma,
        max_anchors=a.anchors,
        per_position_loss_weight=a.weighting,
    )
    if a.model == "dflash2":
        kw["selector_loss_alpha"] = a.selector_alpha
    elif a.model == "dspark":
        kw["confidence_head_alpha"] = a.confidence_alpha
    train_kw, _val_kw = model_class(a.model).get_trainer_kwargs(**kw)
    return train_kw


def describe(model) -> str:
    """One line naming the model's head settings, read back from its config."""
    c = model.config
    parts = [f"sample_from_anchor {c.sample_from_anchor}",
             f"sliding_window_non_causal {c.sliding_window_non_causal}"]
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov"):
        if hasattr(c, key):
            parts.append(f"{key} {getattr(c, key)}")
    return ", ".join(parts)


def extra_flops(a) -> dict:
    """Dense FLOPs the DFlash2 / DSpark heads add on the Q = anchors*block draft tokens."""
    H, V, L = a.hidden, a.vocab, a.layers
    Q = a.anchors * a.block
    f = {}
    if a.model == "dflash2":
        proj_out = 2 * a.conv_kernel * (H // a.conv_group)
        f["conv_projections"] = 6 * 2 * L * H * proj_out * Q  # 2 convs per layer, fwd + dX + dW
        f["selector"] = 6 * a.selector_rank * H * Q + 6 * Q * a.selector_top_k * a.selector_rank
    elif a.model == "dspark" and a.markov_rank > 0:
        f["markov_w2"] = 6 * a.markov_rank * V * Q
        if a.confidence:
            f["confidence"] = 6 * (H + a.markov_rank) * Q
    return f


def extra_metrics(metrics: dict) -> str:
    """Selector accuracy (dflash2) or confidence loss (dspark) for the step line."""
    out = []
    for name, key in (("sel_acc", "teacher_forced_selector_acc"),
                      ("conf_loss", "confidence_loss"),
                      ("eal", "eal")):
        s, t = metrics.get(f"{key}_sum"), metrics.get(f"{key}_total")
        if s is not None and t is not None:
            out.append(f"{name} {float(s) / max(float(t), 1e-9):.4f}")
    return (" " + " ".join(out)) if out else ""


def recipes_text() -> str:
    lines = ["per-model defaults (flags left unset):"]
    for name, r in RECIPES.items():
        lines.append(f"  {name}: " + ", ".join(f"--{k} {v}" for k, v in r.items()))
    return "\n".join(lines)
