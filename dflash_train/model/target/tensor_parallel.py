"""Tensor parallelism of a frozen target over a 1-D DeviceMesh (a target group).

The plan is the model config's own `base_model_tp_plan` (transformers ships one per architecture:
attention q/k/v and MLP gate/up column-wise, o_proj and down_proj row-wise), applied with torch's
`parallelize_module`. Every linear returns plain local tensors (`use_local_output=True`): the HF
attention reshapes with `view(*input_shape, -1, head_dim)`, so a rank's q/k/v shards simply hold
`heads / tp` heads, and the row-wise layers all-reduce back to the full hidden state. Embedding,
final norm and lm_head stay whole (replicated) on every rank: taps, the final hidden state and the
drafter's frozen lm_head read them as plain tensors.

Fused MoE experts (3-D `gate_up_proj` / `down_proj` parameters, `packed_colwise` and
`moe_tp_experts` in the plan) are no `nn.Linear`, so torch's styles cannot shard them; those
entries go through transformers' own DTensor styles of the same names (each rank keeps its slice
of every expert's intermediate width and the experts' outputs are summed over the group).

Hybrid targets (Qwen3-Next, Qwen3.5) have attention in some layers and linear attention in the
others; plan entries are expanded to the concrete modules each layer has. Their linear-attention
projections are `colwise_gather_output` in transformers' plans: weights sharded, outputs gathered,
the recurrence computed whole on every rank. Sliding-window layers (Gemma 3) shard like full ones.
A plan that shards no decoder layer (gpt-oss's names only its embedding) is refused: every rank
would hold the whole target. Tested against single-process taps: tests/model/target/test_tensor_parallel.py.
"""

from __future__ import annotations

import re

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# plan style -> torch style. The `_rep` / gather variants return the full (replicated) output.
_TORCH_STYLES = {
    "colwise": lambda: ColwiseParallel(use_local_output=True),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
    "rowwise": lambda: RowwiseParallel(use_local_output=True),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=True),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), use_local_output=True),
}
# q_norm / k_norm act on one head's head_dim: the same on every rank's heads; their gradient
# all-reduce is for training, and a target is frozen. Embeddings stay whole (module doc).
_NOTHING_TO_DO = ("replicated_with_grad_allreduce", "replicate", "embedding_rowwise")
# fused experts: transformers' styles (see module doc)
_TRANSFORMERS_STYLES = ("packed_colwise", "packed_rowwise", "moe_tp_experts")
# an expert's `down_proj` is a 3-D parameter that the plan calls "rowwise"
_EXPERT_PARAM = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def tp_plan_of(config) -> dict[str, str]:
    """The architecture's tensor-parallel plan (module pattern -> style), from the config."""
    plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"target model_type {config.model_type!r} has no tensor-parallel plan "
                         "(config.base_model_tp_plan is empty): use topology.target_group_size=1")
    return dict(plan)


# the config fields whose widths a group shards: whole heads per rank, equal MLP slices (hybrid
# targets' linear-attention layers shard their heads too)
SHARDED_WIDTHS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                  "linear_num_key_heads", "linear_num_value_heads")


def indivisible_widths(widths: dict, tp: int) -> dict[str, int]:
    """The widths among `widths` (field -> value; None or absent when a target has none) that `tp` does not divide."""
    return {name: n for name, n in widths.items() if name in SHARDED_WIDTHS and isinstance(n, int) and n % tp}


def check_tp_divisible(config, tp: int) -> None:
    """Every sharded width divides by the group size: a shard is whole heads and equal slices."""
    text = config.get_text_config()
    widths = {name: getattr(text, name, None) for name in SHARDED_WIDTHS}
    bad = indivisible_widths(widths, tp)
    if bad:
        listed = ", ".join(f"{name}={n}" for name, n in bad.items())
        divisors = [d for d in range(1, tp + 1) if not indivisible_widths(widths, d)]
        raise ValueError(f"target {text.model_type}: {listed} not divisible by topology.target_group_size={tp}; "
                         f"group sizes that divide every sharded width: {divisors}")


def shard_target(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard a loaded HF causal LM's decoder layers over `mesh` (1-D, the group's ranks), in place.

    Every rank must hold the same full weights (loaded from the same files): each keeps its own
    slice without any transfer (`src_data_rank=None`). Returns `model`."""
    if mesh.ndim != 1:
        raise ValueError(f"shard_target takes a 1-D mesh (one target group), got {mesh.ndim}-D")
    tp = mesh.size()
    check_tp_divisible(model.config, tp)
    if tp == 1:
        return model
    torch_plan, hf_plan = split_plan(model)
    parallelize_module(model, mesh, torch_plan, src_data_rank=None)
    if hf_plan:
        _apply_transformers_styles(model, mesh, hf_plan)
    return model


def split_plan(model: nn.Module) -> tuple[dict, dict]:
    """The config's plan as (torch styles by concrete module name, transformers styles by pattern for
    fused experts); refuses a style it cannot apply and a plan that shards no decoder layer."""
    prefix = model.base_model_prefix
    torch_plan, hf_plan = {}, {}
    for pattern, style in tp_plan_of(model.config).items():
        name = f"{prefix}.{pattern}" if prefix else pattern
        if style in _NOTHING_TO_DO:
            continue
        if style in _TRANSFORMERS_STYLES or _EXPERT_PARAM.search(pattern):
            hf_plan[name] = style
        elif style in _TORCH_STYLES:
            torch_plan[name] = _TORCH_STYLES[style]
        else:
            raise ValueError(f"target {model.config.model_type}: tensor-parallel style {style!r} of {pattern!r} "
                             "is not supported; use topology.target_group_size=1")
    # concrete names: hybrid targets' layers differ (linear_attn or self_attn), and a dense entry of
    # an all-MoE model names nothing; a wildcard torch cannot resolve everywhere only warns
    modules = [name for name, _ in model.named_modules()]
    torch_plan = {name: make() for pattern, make in torch_plan.items() for name in _matching(modules, pattern)}
    if not torch_plan and not hf_plan:
        raise ValueError(f"target {model.config.model_type}: its tensor-parallel plan "
                         f"{tp_plan_of(model.config)} shards no decoder layer (each rank would hold the whole "
                         "target); use topology.target_group_size=1")
    return torch_plan, hf_plan


def _matching(names: list[str], pattern: str) -> list[str]:
    regex = _pattern_regex(pattern)
    return [name for name in names if regex.match(name)]


def _pattern_regex(pattern: str) -> re.Pattern:
    """A plan pattern (`model.layers.*.mlp`) as a regex; `*` stands for a layer number."""
    return re.compile(pattern.replace(".", r"\.").replace("*", r"\d+") + "$")


def _apply_transformers_styles(model: nn.Module, mesh: DeviceMesh, plan: dict[str, str]) -> None:
    """Expand wildcard entries to concrete module/parameter names, then let transformers shard
    them (its `apply_tensor_parallelism` wants concrete names)."""
    # transformers' DTensor styles, only for fused experts (see module doc); heavy import kept local
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    concrete = {name: style for pattern, style in plan.items() for name in _matching(names, pattern)}
    apply_tensor_parallelism(model, mesh, concrete)


def group_mesh(groups: list[list[int]], device_type: str) -> DeviceMesh | None:
    """The 1-D mesh of this rank's target group (None when it is in none). Collective over the
    whole world: `new_group` must be called by every rank, for every group, in the same order."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = DeviceMesh.from_group(group, device_type)
    return mine
