"""`dflash-train export --drafter DIR --out OUT [--format zlab|speculators] [--target T]`.

zlab: a clean bf16 copy of a drafter directory (for example a training checkpoint's float32
`drafter/`). speculators: the `DFlashSpeculator` layout, which also carries the target's embedding
and lm_head, so it needs `--target`.
"""

from __future__ import annotations

import argparse

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="z-lab drafter directory (ours or published)")
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=("zlab", "speculators"), default="zlab")
    p.add_argument("--target", help="target model (needed for --format speculators)")
    p.add_argument("--verifier-name", help="name recorded as the verifier (default: --target)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")


def command(args: argparse.Namespace) -> int:
    from dflash_train.model.hf_format import export_drafter, load_zlab, save_speculators

    try:
        drafter = load_zlab(args.drafter)
        dtype = DTYPES[args.dtype]
        if args.format == "zlab":
            out = export_drafter(drafter, args.out, args.target, dtype=dtype)  # records the target, checks
        else:
            if not args.target:
                raise ValueError("--format speculators needs --target (its embedding and lm_head are stored)")
            from dflash_train.model.target import load_target

            target = load_target(args.target)
            drafter.config.check_target(target.hidden_size, target.num_layers, target.vocab_size)
            out = save_speculators(drafter, args.out, target.embed_weight, target.lm_head_weight,
                                   args.verifier_name or args.target, list(target.config.architectures or []),
                                   dtype=dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"dflash-train export: FAILED: {e}", flush=True)
        return 1
    print(f"dflash-train export: OK {args.format} drafter written to {out}", flush=True)
    return 0
