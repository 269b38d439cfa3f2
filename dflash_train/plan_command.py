"""`dflash-train plan --target T [--gpus N] [--gpu-gib G] [--recipe R] [section.field=value ...]`.

Prints the memory of a target process, a drafter process and a colocated process at the run's
shapes, every layout of N GPUs, and the smallest layouts that fit, with the expected tokens/s
(dflash_train/plan.py: the arithmetic and which measured figures it scales). Loads no weights.
"""

from __future__ import annotations

import argparse

from dflash_train import plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True,
                   help=f"a known shape ({', '.join(plan.KNOWN_TARGETS)}), an HF model dir or a config.json")
    p.add_argument("--gpus", type=int, default=8, help="GPUs available (one process per GPU)")
    p.add_argument("--gpu-gib", type=float, default=plan.H200_GIB, help="memory of one GPU in GiB (H200: 139.8)")
    p.add_argument("--recipe", default="paper", help="run settings to plan for (recipes.py)")
    p.add_argument("overrides", nargs="*", help="section.field=value settings, as for train")


def command(args: argparse.Namespace) -> int:
    from dflash_train import recipes
    from dflash_train.config import apply_overrides

    try:
        cfg = apply_overrides(recipes.get(args.recipe), args.overrides)
        shape = plan.target_shape(plan.load_target_config(args.target))
        run = plan.RunShape.from_run_config(cfg)
        print(f"plan: {args.target}: {shape.total_params / 1e9:.2f}B parameters ({shape.active_params / 1e9:.2f}B "
              f"active), {shape.layers} layers, hidden {shape.hidden}; drafter {run.drafter_layers} layers, "
              f"block {run.block_size}, {run.num_anchors} anchors, seq {run.seq_len}, micro-batch "
              f"{run.micro_batch}, accumulation {run.grad_accum}", flush=True)
        print(f"  target process   {plan.target_memory(shape, run, run.max_in_flight).describe()}")
        print(f"  drafter process  {plan.drafter_memory(shape, run, in_flight=run.max_in_flight).describe()}")
        print(f"  colocated        {plan.colocated_memory(shape, run).describe()}")
        for layout in plan.layouts(shape, run, args.gpus, args.gpu_gib):
            print(f"  {layout.describe(args.gpu_gib)}")
        best = plan.smallest_fitting(shape, run, args.gpus, args.gpu_gib)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"dflash-train plan: FAILED: {e}", flush=True)
        return 1
    if not best:
        need = plan.weights_need_gpus(shape, args.gpu_gib)
        print(f"dflash-train plan: FAILED: no layout of up to {args.gpus} GPUs of {args.gpu_gib:.0f} GiB fits; the "
              f"weights alone need a target group of {need} GPUs (tensor parallelism: not built yet)", flush=True)
        return 1
    print(f"dflash-train plan: OK smallest: {best[0].name} on {best[0].gpus} GPU(s), ~{best[0].tokens_per_s / 1e3:.1f}K "
          f"tok/s (H200 rates of docs/PERF.md 3.1 scaled by FLOPs)", flush=True)
    return 0
