"""FP8 support: whether this machine can run float8 matmuls, and which linear layers can.

FP8 runs through torchao (the optional extra `pip install dflash-train[fp8]`): float8 training of
the drafter (`train.parallel.convert_to_fp8`) and float8 inference of the frozen target
(`model.target.Target.quantize_fp8`). Both need a CUDA GPU of compute capability >= 8.9 (Ada,
Hopper or newer), whose tensor cores run e4m3/e5m2 matmuls at twice the bf16 rate.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from typing import NamedTuple

import torch
from torch import nn

FP8_MIN_CAPABILITY = (8, 9)
FP8_ALIGN = 16  # float8 matmuls (torch._scaled_mm) need both dimensions of each operand divisible by 16
INSTALL_HINT = "pip install 'dflash-train[fp8]' (torchao>=0.12)"


def fp8_problem(device: torch.device | str | None = None) -> str | None:
    """Why FP8 cannot run on `device` (None: the current CUDA device, else the CPU), or None."""
    if importlib.util.find_spec("torchao") is None:
        return f"torchao is not installed: {INSTALL_HINT}"
    try:
        import torchao.float8  # noqa: F401 - optional dependency: does it import with this torch?
    except Exception as e:  # noqa: BLE001 - any import failure means the same thing here
        return f"torchao does not import with torch {torch.__version__}: {type(e).__name__}: {e}"
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return f"float8 matmuls need a CUDA GPU (compute capability >= 8.9); this run is on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}; "
                "float8 matmuls need >= 8.9 (Ada, Hopper or newer)")
    return None


FP8_AUTO_MIN_WIDTH = 4096
"""train.precision=auto trains drafters at least this wide in fp8. Measured on one H200: at the paper
shapes (width 4096) float8 linears and lm_head make the step 1.24x faster (27.1K vs 21.9K tok/s, one
call, session 10); at SmolLM2's width 576 float8 is slower (0.78x-0.81x the steps per second,
sessions 7 and 11: the casts cost more than the small matmuls save). Real tau at equal steps matched
bf16 (session 11, docs/LOG.md). Widths in between are unmeasured and stay bf16."""


def resolve_precision(setting: str, device: torch.device | str, width: int, compiled: bool = True) -> tuple[str, str]:
    """train.precision -> (bf16 | fp8, why), read once per run; `width` is the drafter's hidden size.
    auto keeps bf16 for an uncompiled drafter: float8 pays only with its casts fused (measured compiled)."""
    if setting in ("bf16", "fp8"):
        return setting, f"train.precision={setting}"
    if setting != "auto":
        raise ValueError(f"train.precision={setting!r}: expected auto, bf16 or fp8")
    if torch.device(device).type != "cuda":
        return "bf16", "auto: no float8 off CUDA"
    if not compiled:
        return "bf16", "auto: float8 pays only compiled (train.compile=off)"
    return auto_precision(fp8_problem(device), width)


def auto_precision(problem: str | None, width: int) -> tuple[str, str]:
    """The rule of train.precision=auto: (bf16 | fp8, why), given why this machine cannot run float8
    (`fp8_problem`, None if it can) and the drafter's width."""
    if problem is not None:
        return "bf16", f"auto: {problem}"
    if width < FP8_AUTO_MIN_WIDTH:
        return "bf16", f"auto: drafter width {width} < {FP8_AUTO_MIN_WIDTH}, where float8 casts cost more than they save"
    return "fp8", f"auto: drafter width {width} >= {FP8_AUTO_MIN_WIDTH} on a float8 GPU"


def require_fp8(device: torch.device | str | None, option: str) -> None:
    """Raise a RuntimeError naming `option` (e.g. `train.precision`) and how to turn FP8 off."""
    problem = fp8_problem(device)
    if problem is not None:
        raise RuntimeError(f"{option}=fp8: {problem}; set {option}=bf16 to run without FP8")


def fp8_aligned(*dims: int) -> bool:
    """Every dimension a multiple of FP8_ALIGN: what float8 matmuls accept."""
    return all(d % FP8_ALIGN == 0 for d in dims)


def fp8_fits(module: nn.Module, fqn: str = "") -> bool:
    """A linear layer whose in and out features are multiples of 16 (torchao's module filter)."""
    return isinstance(module, nn.Linear) and fp8_aligned(module.in_features, module.out_features)


FP8_FILTERS = ("auto", "all")


def fp8_module_filter(recipe: str, which: str = "auto"):
    """The (module, fqn) -> bool filter of the linear layers that run in float8 (train.fp8_filter).
    all: every linear whose dims are multiples of 16. auto: torchao's size rule for the recipe on top
    (`torchao.float8._auto_filter_for_recipe`, from its H100 tables: tensorwise keeps K <= 4096 with
    N <= 1024 in bf16, e.g. GQA k/v projections, whose casts cost more than their float8 matmul saves)."""
    if which == "all":
        return fp8_fits
    if which != "auto":
        raise ValueError(f"train.fp8_filter={which!r}: expected one of {', '.join(FP8_FILTERS)}")
    try:  # optional dependency, imported only when FP8 is asked for
        from torchao.float8 import _auto_filter_for_recipe
    except ImportError as e:
        raise RuntimeError(f"train.fp8_filter=auto needs torchao's size rule (torchao.float8._auto_filter_for_recipe), "
                           f"which this torchao lacks ({e}); upgrade torchao or set train.fp8_filter=all") from e
    return _auto_filter_for_recipe(recipe, filter_fqns=[])


def split_linears(root: nn.Module, keep=fp8_fits) -> tuple[list[str], list[str]]:
    """(names of the linear layers `keep` sends to FP8, names of the other linear layers) under `root`."""
    linears = [(name, m) for name, m in root.named_modules() if isinstance(m, nn.Linear)]
    return [n for n, m in linears if keep(m, n)], [n for n, m in linears if not keep(m, n)]


def describe_conversion(what: str, recipe: str, converted: list[str], skipped: list[str],
                        root: nn.Module) -> str:
    """One line: how many linear layers run in FP8, and the shapes of those kept in bf16 and why."""
    line = f"fp8: {what}: {len(converted)} of {len(converted) + len(skipped)} linear layers in float8 ({recipe})"
    reasons: dict[str, Counter] = {}
    for name in skipped:
        module = root.get_submodule(name)
        why = "size rule" if fp8_fits(module) else "dims not multiples of 16"
        reasons.setdefault(why, Counter())[tuple(module.weight.shape)] += 1
    for why, shapes in reasons.items():
        line += f"; kept in bf16 ({why}): " + ", ".join(f"{n} x {s}" for s, n in shapes.items())
    return line


class Float8Head(NamedTuple):
    """The frozen lm_head [V, H] in float8 (e4m3, one scale for the tensor, cast once per run: it never
    changes), in both layouts the loss's two matmuls need as torchao `Float8TrainingTensor`s."""

    for_logits: torch.Tensor
    """W^T [H, V], column-major: logits = hidden @ W^T."""
    for_grad: torch.Tensor
    """W [V, H], column-major: d hidden = d logits @ W."""


def _mm_config():
    from torchao.float8.float8_training_tensor import LinearMMConfig

    return LinearMMConfig()  # torchao's Float8Linear defaults: fast accumulation for the output gemm only


def float8_head(weight: torch.Tensor) -> Float8Head:
    """`weight` [V, H] as a Float8Head; both dims must be multiples of 16 (float8 gemms need it)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    if not fp8_aligned(*weight.shape):
        raise ValueError(f"train.fp8_lm_head: the lm_head {tuple(weight.shape)} is not a multiple of {FP8_ALIGN} "
                         "in both dims (float8 matmuls need it); set train.fp8_lm_head=false")
    w = weight.detach()

    def cast(t: torch.Tensor) -> torch.Tensor:
        return hp_tensor_to_float8_dynamic(t, torch.float8_e4m3fn, _mm_config(), gemm_input_role=GemmInputRole.WEIGHT)

    return Float8Head(cast(w).t(), cast(w.t().contiguous()).t())


def float8_mm(x: torch.Tensor, weight8: torch.Tensor, gradient: bool = False) -> torch.Tensor:
    """x [m, K] @ weight8 (a Float8Head member) with x cast dynamically, one scale per call: e4m3 for
    activations, e5m2 for gradient logits (their range matters more than their precision; torchao's
    choice for grad outputs). Returns [m, N] in x's dtype."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    role = GemmInputRole.GRAD_OUTPUT if gradient else GemmInputRole.INPUT
    dtype = torch.float8_e5m2 if gradient else torch.float8_e4m3fn
    return torch.mm(hp_tensor_to_float8_dynamic(x, dtype, _mm_config(), gemm_input_role=role), weight8)
