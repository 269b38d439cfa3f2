"""The dtype the eval decodes in (`eval.dtype`), and a copy of the target and drafter cast to it.

On a CPU the verify pass (B rows) is compute-bound and the plain step (one row) is bound by the weight
read: in float32 on the 2-core EPYC with AVX-512 BF16 a draft+verify cycle cost 1.96 plain steps, in
bfloat16 1.39 (the multi-row GEMMs run on the bf16 dot-product units; the one-row step barely gains),
which is what moved README command 1 above 1.0x (docs/PERF.md section 6, 2026-12-05). So `auto`
decodes in bfloat16 where the CPU has bf16 units (oneDNN says so) and the target is float32; elsewhere
in the target's own dtype. Both decoders run in the same dtype, so the speedup compares like with
like; greedy outputs may then leave plain decoding at near-ties, which `eval/lossless.py` explains
or fails. Training is over when the eval runs, but the simulated tau beside it still reads the
training-dtype target, so the cast is a copy, made once per eval.
"""

from __future__ import annotations

import copy

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (AVX-512 BF16 or AMX), as oneDNN reports it."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve(setting: str, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`eval.dtype` -> the dtype both decoders run in (see the module doc for `auto`)."""
    if setting == "target":
        return target_dtype
    if setting == "auto":
        if device.type == "cpu" and target_dtype == torch.float32 and cpu_has_bf16():
            return torch.bfloat16
        return target_dtype
    return DTYPES[setting]


def cast_pair(target, drafter, dtype: torch.dtype):
    """(target, drafter) in `dtype`: the very objects when they are in it already, else copies."""
    if target.dtype == dtype and next(drafter.parameters()).dtype == dtype:
        return target, drafter
    cast = copy.copy(target)  # the dataclass's fields; the model below is a new module
    cast.model = copy.deepcopy(target.model).to(dtype)
    return cast, copy.deepcopy(drafter).to(dtype)
