"""`dflash-train export --drafter DIR --out OUT [--format zlab|speculators] [--target T]`.

zlab: a clean bf16 copy of a drafter directory (for example a training checkpoint's float32
`drafter/`), its draft vocabulary in the engines' reduced form where its head's engines serve one (the
rows copied from target.model's lm_head). speculators: the `DFlashSpeculator` layout, which also carries
the target's embedding and lm_head (target.model, loaded on the CPU unless topology.device says otherwise),
reduced to the draft vocabulary the same way (with speculators' `t2d`).
"""

from __future__ import annotations

from dflash_train.commands import Alias, load_configured_target
from dflash_train.validate import validate_export as validate  # noqa: F401 - the command's check

HELP = "export a drafter checkpoint (z-lab or speculators format)"
RECIPE = None
READS = ("export", "target.model", "target.gguf_file", "target.dtype", "target.trust_remote_code", "topology.device")
ALIASES = (
    Alias("--drafter", "export.drafter"), Alias("--out", "export.out"), Alias("--format", "export.format"),
    Alias("--target", "target.model"), Alias("--verifier-name", "export.verifier_name"),
    Alias("--dtype", "export.dtype"),
)


def run(cfg) -> str:
    import torch  # see commands/__init__.py

    from dflash_train.model.drafter.export.export import export_drafter
    from dflash_train.model.drafter.export.draft_vocab import load_draft_vocab
    from dflash_train.model.drafter.export.hf_format import load_zlab, save_speculators

    x = cfg.export
    drafter = load_zlab(x.drafter)
    dtype = getattr(torch, x.dtype)
    if x.format == "zlab":
        # records target.model as the training target and checks the serving contract against it;
        # a draft vocabulary travels with the weights
        out = export_drafter(drafter, x.out, cfg.target.model, cfg.target.gguf_file, dtype=dtype,
                             draft_vocab=load_draft_vocab(x.drafter, drafter.config.vocab_size))
    else:
        target = load_configured_target(cfg, fallback_device="cpu")
        drafter.config.check_target(target.hidden_size, target.num_layers, target.vocab_size)
        out = save_speculators(drafter, x.out, target.embed_weight, target.lm_head_weight,
                               x.verifier_name or cfg.target.model, list(target.config.architectures or []),
                               dtype=dtype, draft_vocab=load_draft_vocab(x.drafter, drafter.config.vocab_size))
    return f"{x.format} drafter written to {out}"
