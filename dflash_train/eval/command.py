"""`dflash-train eval --drafter DIR --target T [...]`: real speculative decoding of held-out prompts
with a z-lab drafter directory (ours or a published one) against its HF target.

Prints a summary table and ends with `dflash-train eval: OK tau=... speedup=...x` or
`dflash-train eval: FAILED: <cause>` (exit status 1). Writes report.json and two PNG plots to --out.
"""

from __future__ import annotations

import argparse
import traceback

from dflash_train.config import EvalConfig
from dflash_train.eval.prompt_sets import load_prompt_sets

_DEFAULTS = EvalConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="z-lab drafter directory (config.json + *.safetensors)")
    p.add_argument("--target", required=True, help="'smollm2', a .gguf file, or a local HF model directory")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --target")
    p.add_argument("--prompts", default=_DEFAULTS.prompts,
                   help="prompt sets: default (assistant,chitchat), a comma list of chitchat, assistant, humaneval "
                        "and JSONL paths of ShareGPT/OpenAI conversations")
    p.add_argument("--num-prompts", type=int, default=_DEFAULTS.num_prompts, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=_DEFAULTS.max_new_tokens)
    p.add_argument("--temperature", type=float, default=_DEFAULTS.temperature, help="0 = greedy")
    p.add_argument("--thinking", choices=("on", "off"), default=None,
                   help="enable_thinking for templates that read it (default: the template's own default)")
    p.add_argument("--block-size", type=int, default=None, help="override the drafter's block size")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="auto", help="target and drafter dtype: auto (bf16 on GPU, fp32 on CPU), "
                                                   "float32, bfloat16, float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="dflash-eval", help="output directory for report.json and the plots")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run(args: argparse.Namespace) -> dict:
    import torch

    from dflash_train.eval.evaluate import check_compatible, evaluate
    from dflash_train.model.hf_format import load_zlab
    from dflash_train.model.target import load_target

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, gguf_file=args.gguf_file, dtype=args.dtype, device=device,
                         trust_remote_code=args.trust_remote_code)
    drafter = load_zlab(args.drafter, device=device, dtype=target.dtype)
    print(f"eval: drafter {args.drafter}: {drafter.config.num_layers} layers, block size "
          f"{args.block_size or drafter.config.block_size}, taps {list(drafter.config.target_layer_ids)}, "
          f"mask token {drafter.config.mask_token_id}", flush=True)
    check_compatible(drafter, target)  # before reading prompts: fail fast on the wrong pair
    sets = load_prompt_sets(args.prompts, args.num_prompts)
    print("eval: " + ", ".join(f"{n}: {len(p)} prompts" for n, p in sets.items())
          + f"; max {args.max_new_tokens} new tokens, temperature {args.temperature}", flush=True)
    thinking = None if args.thinking is None else args.thinking == "on"
    return evaluate(drafter, target, sets, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    thinking=thinking, block_size=args.block_size, seed=args.seed, out_dir=args.out,
                    progress=not args.no_progress)


def command(args: argparse.Namespace) -> int:
    from dflash_train.eval.report import lossless_note, summary_table

    try:
        report = _run(args)
    except (ValueError, FileNotFoundError) as e:  # user errors: the message says it all
        print(f"dflash-train eval: FAILED: {e}", flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - every failure ends with a verdict and a non-zero exit
        traceback.print_exc()
        print(f"dflash-train eval: FAILED: {type(e).__name__}: {e}", flush=True)
        return 1
    print(summary_table({**report["sets"], "overall": report["overall"]}), flush=True)
    for name, figures in report["sets"].items():
        note = lossless_note(figures, report["dtype"] == "float32", args.temperature)
        if note:
            print(f"eval [{name}]: {note}", flush=True)
    print(f"eval: report {report['report']}; plots {', '.join(report['plots'])}", flush=True)
    overall = report["overall"]
    print(f"dflash-train eval: OK tau={overall['tau']:.3f} speedup={overall['speedup']:.2f}x "
          f"({overall['num_prompts']} prompts, {overall['spec_tokens']} tokens)", flush=True)
    return 0
