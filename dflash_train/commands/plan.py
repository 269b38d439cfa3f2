"""`dflash-train plan --target T [--gpus N] [--gpu-gib G] [--recipe R] [section.field=value ...]`.

Prints the memory of a target process, a drafter process and a colocated process at the run's
shapes, every layout of N GPUs, and the smallest layouts that fit, with the expected tokens/s
(dflash_train/plan.py: the arithmetic and which measured figures it scales). Loads no weights.
The target is a known shape (qwen3-8b, qwen3-30b-a3b, llama-3.3-70b), an HF model directory or a
config.json file.
"""

from __future__ import annotations

from dflash_train.commands import Alias, Verdict
from dflash_train.validate import validate_plan as validate  # noqa: F401 - the command's check

HELP = "memory per process, layouts that fit, expected tokens/s"
RECIPE = "paper"
READS = ("plan", "target.model", "drafter.num_layers", "drafter.block_size", "drafter.num_taps", "data.max_len",
         "train.num_anchors", "train.micro_batch", "train.seqs_per_step", "loss.chunk_tokens",
         "topology.max_in_flight")
ALIASES = (Alias("--target", "target.model"), Alias("--gpus", "plan.gpus"),
           Alias("--gpu-gib", "plan.gpu_memory_gib"))


def run(cfg) -> str | Verdict:
    from dflash_train import plan  # imports torch and transformers (see commands/__init__.py)

    gpus, gib = cfg.plan.gpus, cfg.plan.gpu_memory_gib
    shape = plan.target_shape(plan.load_target_config(cfg.target.model))
    run_shape = plan.RunShape.from_run_config(cfg)
    print(f"plan: {cfg.target.model}: {shape.total_params / 1e9:.2f}B parameters ({shape.active_params / 1e9:.2f}B "
          f"active), {shape.layers} layers, hidden {shape.hidden}; drafter {run_shape.drafter_layers} layers, "
          f"block {run_shape.block_size}, {run_shape.num_anchors} anchors, seq {run_shape.seq_len}, micro-batch "
          f"{run_shape.micro_batch}, accumulation {run_shape.grad_accum}", flush=True)
    print(f"  target process   {plan.target_memory(shape, run_shape, run_shape.max_in_flight).describe()}")
    print(f"  drafter process  {plan.drafter_memory(shape, run_shape, in_flight=run_shape.max_in_flight).describe()}")
    print(f"  colocated        {plan.colocated_memory(shape, run_shape).describe()}")
    for layout in plan.layouts(shape, run_shape, gpus, gib):
        print(f"  {layout.describe(gib)}")
    best = plan.smallest_fitting(shape, run_shape, gpus, gib)
    if not best:
        need = plan.weights_need_gpus(shape, gib)
        return Verdict(f"no layout of up to {gpus} GPUs of {gib:.0f} GiB fits, target groups of up to 8 included; "
                       f"the weights alone need a target group of {need} GPUs", status="FAILED:", exit_code=1)
    return (f"smallest: {best[0].name} on {best[0].gpus} GPU(s), ~{best[0].tokens_per_s / 1e3:.1f}K tok/s "
            f"(H200 rates of docs/PERF.md 3.1 scaled by FLOPs; target groups assumed to scale ideally): "
            f"{best[0].overrides()}")
