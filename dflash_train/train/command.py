"""`dflash-train train [--recipe NAME] [section.field=value ...]`.

Run directly (one process) or under torchrun (one process per GPU, any number of nodes). With no
arguments it runs the embedded default recipe end to end on CPU (or a GPU when there is one).
A rank that fails prints its error and exits at once with status 1, so torchrun stops the job.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from dflash_train import recipes
from dflash_train.config import apply_overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="default", help=f"named run: {', '.join(recipes.RECIPES)}")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.out_dir")
    p.add_argument("overrides", nargs="*", help="section.field=value, e.g. train.max_steps=100")


def _summary(result: dict) -> str:
    sim = result.get("sim") or {}
    lines = [f"trained {result['steps']}/{result['total_steps']} steps, {result['tokens']} tokens; "
             f"held-out simulated tau {sim.get('sim_tau', float('nan')):.3f}"]
    for name, rep in (result.get("eval") or {}).items():
        lines.append(f"real speculative decoding [{name}]: tau {rep['tau']:.3f}, speedup {rep['speedup']:.2f}x "
                     f"({rep.get('num_prompts', '?')} prompts)")
    lines.append(f"checkpoint: {result.get('checkpoint')}\ndrafter (z-lab format): {result.get('export')}")
    if result.get("report"):
        lines.append(f"report: {result['report']}")
    from dflash_train.model.serving_check import serve_instructions  # torch: not for --print-config

    lines.append(serve_instructions(result["export"]))  # the recorded training target, block_size - 1 tokens
    return "\n".join(lines)


def command(args: argparse.Namespace) -> int:
    try:
        cfg = apply_overrides(recipes.get(args.recipe), args.overrides + (["train.resume=true"] if args.resume else []))
    except ValueError as e:
        print(f"dflash-train train: FAILED: {e}", flush=True)
        return 2
    if args.print_config:
        print(cfg.to_json(), flush=True)
        return 0
    from dflash_train.train.loop import train

    try:
        result = train(cfg)
    except Exception as e:  # noqa: BLE001 - every failure ends with a verdict and a non-zero exit
        rank = os.environ.get("RANK", "0")
        traceback.print_exc()
        print(f"dflash-train train: FAILED on rank {rank}: {type(e).__name__}: {e}", flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.environ.get("WORLD_SIZE", "1") != "1":
            os._exit(1)  # do not wait on peers that may be blocked in a collective: torchrun ends the job
        return 1
    if result.get("role") == "drafter" and "export" in result:
        print(_summary(result), flush=True)
    status = "INTERRUPTED" if result.get("interrupted") else "OK"
    print(f"dflash-train train: {status} (rank {os.environ.get('RANK', '0')}, {result.get('role')}, "
          f"{result.get('steps', '-')} steps)", flush=True)
    return 0 if status == "OK" else 3
