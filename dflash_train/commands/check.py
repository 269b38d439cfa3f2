"""`dflash-train check DRAFTER --target T`: will this drafter be served right with that target?

Lists every failure of the serving contract (dflash_train/model/drafter/export/check.py), each naming its
field, then a line per engine (vLLM, SGLang): what it would refuse to load, or that it loads the drafter
and serves it wrong, or as trained (model/drafter/export/engine_rules.py); then the verdict; exits non-zero on any failure. A drafter of a target that scales its embeddings or
logits gets a note per field saying which engines apply it. Works on a fresh machine for every target form
(a GGUF is converted into the cache once, as training does). Reads the target's files only (config,
safetensors headers, a few sampled bytes); the drafter is loaded on the CPU for one block's forward.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.commands import Alias, Verdict
from dflash_train.validate import validate_check as validate  # noqa: F401 - the command's check

HELP = "check that an exported drafter will be served right with a target (vLLM, SGLang)"
RECIPE = None
POSITIONAL = "check.drafter"
READS = ("check", "target.model", "target.gguf_file")
ALIASES = (Alias("--drafter", "check.drafter"), Alias("--target", "target.model"),
           Alias("--gguf-file", "target.gguf_file"))


def run(cfg) -> str | Verdict:
    # the model code loads here only (see commands/__init__.py)
    from dflash_train.model.drafter.export.engine_rules import verdicts
    from dflash_train.model.drafter.export.hf_format import TRAINED_AGAINST
    from dflash_train.model.drafter.export.check import check_drafter
    from dflash_train.model.drafter.export.serve import engine_notes, serve_instructions
    from dflash_train.model.target.identity import describe_target

    drafter_dir = cfg.check.drafter
    target = describe_target(cfg.target.model, cfg.target.gguf_file)
    print(f"check: target {target.name}: {target.path} ({target.quantization or 'unquantised'}), "
          f"{target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}", flush=True)
    failures = check_drafter(drafter_dir, target)
    for failure in failures:
        print(f"check: FAIL {failure}", flush=True)
    for line in verdicts(failures):
        print(f"check: {line}", flush=True)
    if failures:
        fields = ", ".join(dict.fromkeys(f.field for f in failures))
        return Verdict(f"{len(failures)} problems ({fields})", status="FAILED:", exit_code=1)
    recorded = json.loads((Path(drafter_dir) / "config.json").read_text())["dflash_config"].get(TRAINED_AGAINST)
    if not recorded:
        print("check: no training target recorded in the drafter: the target could not be compared", flush=True)
    for note in engine_notes(drafter_dir):
        print(f"check: note: {note}", flush=True)
    print(serve_instructions(drafter_dir), flush=True)
    return f"{drafter_dir} serves with {target.name}"
