"""Apply precision (the parameter dtype, then FP8 matmuls), data parallelism and compilation to a
pure drafter, in that order.

The model file knows nothing of them; `parallelize` is the one place that sets the drafter's
parameter dtype and swaps its linear layers for torchao's Float8Linear (`train.precision=fp8`). Compilation happens once per process (never in threads),
with static shapes, and writes its kernels to a shared on-disk inductor cache so later processes
(other ranks, a resumed job) reuse them instead of compiling again.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dflash_train.fp8 import describe_conversion, fp8_module_filter, require_fp8, split_linears

PRECISIONS = ("bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")


def use_shared_compile_cache(cache_dir: str | Path) -> Path:
    """Point inductor's FX-graph and AOT-autograd caches at one directory for all processes."""
    path = Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def resolve_compile(setting: str, device: torch.device) -> bool:
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"train.compile={setting!r}: expected auto, on or off")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def resolve_backend(setting: str, device: torch.device) -> str:
    """flex on CUDA (compiled), sdpa with a dense mask on CPU; explicit settings win."""
    if setting == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if setting not in ("flex", "sdpa", "dense"):
        raise ValueError(f"train.attention={setting!r}: expected auto, flex, sdpa or dense")
    if setting == "flex" and device.type == "cpu":
        raise ValueError("train.attention=flex: flex_attention has no backward on CPU (torch raises "
                         "NotImplementedError); use train.attention=sdpa (the default on CPU)")
    return setting


def apply_precision(module: nn.Module, param_dtype: torch.dtype | None) -> None:
    """Cast the parameters (not the buffers) in place, keeping the Parameter objects the optimizer
    holds. bf16 under MasterWeightAdamW, whose float32 masters were copied before (`optim.param_dtype`)."""
    if param_dtype is None:
        return
    for p in module.parameters():
        p.data = p.data.to(param_dtype)


def convert_to_fp8(drafter: nn.Module, recipe: str = "tensorwise", which: str = "auto") -> tuple[list[str], list[str]]:
    """Swap the drafter's linear layers (decoder projections and fc; the frozen lm_head is not a
    module of the drafter) for torchao's Float8Linear, in place; returns (converted, skipped) names.

    Float8Linear is an nn.Linear subclass that keeps the very same `weight` Parameter (same object,
    dtype and state_dict key): the optimizer built before keeps owning it, checkpoints and the
    z-lab export are unchanged. Each forward casts weight, input and (backward) output gradient to
    float8 with dynamic scales: one per tensor (`tensorwise`) or per row (`rowwise`). Layers whose
    dimensions are not multiples of 16 stay as they are (float8 matmuls cannot take them), and with
    `which`=auto so do those too small for float8 to pay (`fp8.fp8_module_filter`)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"train.fp8_recipe={recipe!r}: expected one of {', '.join(FP8_RECIPES)}")
    # optional dependency (the `fp8` extra), imported only when FP8 is asked for
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    size_rule = fp8_module_filter(recipe, which)
    backbone = getattr(drafter, "backbone_prefixes", ("",))

    def keep(module, fqn: str) -> bool:  # an architecture's head runs in the eager loss: its casts would not fuse
        return fqn.startswith(backbone) and size_rule(module, fqn)

    converted, skipped = split_linears(drafter, keep)
    convert_to_float8_training(drafter, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
    return converted, skipped


def parallelize(drafter: nn.Module, *, device: torch.device, compile_model: bool, dp_group, num_drafters: int,
                param_dtype: torch.dtype | None = None, recompile_limit: int = 16,
                compile_mode: str | None = None, precision: str = "bf16", fp8_recipe: str = "tensorwise",
                fp8_filter: str = "auto", log=print) -> nn.Module:
    """Return the module the training step calls: parameters cast to `param_dtype` (None: as
    they are), linear layers in float8 if `precision` is fp8, DDP-wrapped if D > 1 and the
    parameters stay float32, then compiled (optional). bf16 parameters (an optimizer with float32
    masters) are not wrapped: DDP would reduce their gradients in bf16; the step sums them in
    float32 instead (`grads.Float32Grads`: one float32 all-reduce per step, and rank 0's weights
    broadcast once at the first step, as DDP's constructor does).

    Compiling the DDP module (not wrapping a compiled one) lets dynamo's DDP optimizer split the
    graph at gradient-bucket boundaries, so all-reduces overlap the backward; the float8 casts
    are compiled with the matmuls they feed.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    apply_precision(drafter, param_dtype)
    if precision == "fp8":
        require_fp8(device, "train.precision")
        converted, skipped = convert_to_fp8(drafter, fp8_recipe, fp8_filter)
        log(describe_conversion("drafter", f"{fp8_recipe}, filter {fp8_filter}", converted, skipped, drafter))
    model = drafter
    if num_drafters > 1 and param_dtype is None:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, process_group=dp_group,
                    gradient_as_bucket_view=True)
    if compile_model:
        torch._dynamo.config.recompile_limit = recompile_limit  # shape buckets; each is one graph
        model = torch.compile(model, dynamic=False, mode=compile_mode)
    return model
