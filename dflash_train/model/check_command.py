"""`dflash-train check DRAFTER --target T`: will this drafter be served right with that target?

Lists every failure of the serving contract (`model.serving_check`), each naming its field, then
a verdict; exits non-zero on any failure. Reads the target's files only (config, safetensors
headers, a few sampled bytes); the drafter is loaded on the CPU for one block's forward.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", help="exported drafter directory (z-lab format)")
    p.add_argument("--target", required=True, help="the target it will be served with: smollm2, a local HF "
                                                    "directory, a cached hub id or a .gguf file")
    p.add_argument("--gguf-file", help="GGUF file name inside --target when that is a directory")


def command(args: argparse.Namespace) -> int:
    from dflash_train.model.hf_format import TRAINED_AGAINST
    from dflash_train.model.serving_check import check_drafter, serve_instructions
    from dflash_train.model.target_identity import describe_target

    try:
        target = describe_target(args.target, args.gguf_file)
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"dflash-train check: FAILED: target: {e}", flush=True)
        return 1
    print(f"check: target {target.name}: {target.path} ({target.quantization or 'unquantised'}), "
          f"{target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}", flush=True)
    failures = check_drafter(args.drafter, target)
    for failure in failures:
        print(f"check: FAIL {failure}", flush=True)
    if failures:
        fields = ", ".join(dict.fromkeys(f.field for f in failures))
        print(f"dflash-train check: FAILED: {len(failures)} problems ({fields})", flush=True)
        return 1
    recorded = json.loads((Path(args.drafter) / "config.json").read_text())["dflash_config"].get(TRAINED_AGAINST)
    if not recorded:
        print("check: no training target recorded in the drafter: the target could not be compared", flush=True)
    print(serve_instructions(args.drafter), flush=True)
    print(f"dflash-train check: OK {args.drafter} serves with {target.name}", flush=True)
    return 0
