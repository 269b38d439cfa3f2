"""The training attention as a doctor workload: compile it, check compile health, time it vs eager.

Runs inside a doctor stage child, one process per device. The workload is exactly what a drafter
layer runs in training: `attend(q, k, v, mask, "flex")` under torch.compile, with the BlockMask of
`flex_block_mask` (the compiled builder, as training uses on CUDA) over a realistic DFlash layout.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_train.diagnostics.compile_health import CompileHealthError, warm_up_and_check
from dflash_train.model.drafter.attention import MaskSpec, attend, flex_block_mask


@dataclass(frozen=True)
class AttnShape:
    """One DFlash attention call: `batch` rows of S context positions and N anchor blocks of B."""

    batch: int
    context_len: int  # S
    num_anchors: int  # N
    block_size: int  # B
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str

    def describe(self) -> str:
        """The shape on one line, for the doctor's figure."""
        return (f"b={self.batch} S={self.context_len} N={self.num_anchors} B={self.block_size} "
                f"heads {self.q_heads}/{self.kv_heads} hd {self.head_dim} {self.dtype}")


SHAPES = {
    ("cpu", True): AttnShape(1, 128, 8, 8, 4, 2, 32, "float32"),
    ("cpu", False): AttnShape(2, 256, 16, 8, 4, 2, 32, "float32"),
    ("cuda", True): AttnShape(1, 1024, 128, 16, 32, 8, 128, "bfloat16"),
    ("cuda", False): AttnShape(1, 3072, 512, 16, 32, 8, 128, "bfloat16"),
}


def shape_for(device: torch.device, quick: bool) -> AttnShape:
    """The workload shape for a device kind (CPU small, CUDA training-like)."""
    return SHAPES[(device.type if device.type == "cuda" else "cpu", quick)]


def backward_supported(device: torch.device) -> bool:
    """flex_attention has no CPU backward (NotImplementedError in 2.11-2.13): time fwd only there."""
    return device.type == "cuda"


def make_inputs(shape: AttnShape, device: torch.device, requires_grad: bool):
    """Random q/k/v and a DFlash anchor layout; the last block of each row padded (keep False)."""
    g = torch.Generator().manual_seed(0)
    S, N = shape.context_len, shape.num_anchors
    anchors = torch.stack([torch.randperm(S - 1, generator=g)[:N].sort().values + 1
                           for _ in range(shape.batch)]).to(device)  # [b, N], distinct, in [1, S)
    keep = torch.ones(shape.batch, N, dtype=torch.bool, device=device)
    keep[:, -1] = False
    spec = MaskSpec(S, shape.block_size, N)
    dtype = getattr(torch, shape.dtype)

    def rand(heads: int, length: int) -> torch.Tensor:
        t = torch.randn(shape.batch, heads, length, shape.head_dim, generator=g, dtype=torch.float32)
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    q = rand(shape.q_heads, spec.q_len)  # [b, Hq, N*B, hd]
    k, v = rand(shape.kv_heads, spec.kv_len), rand(shape.kv_heads, spec.kv_len)  # [b, Hkv, S+N*B, hd]
    return spec, anchors, keep, (q, k, v)


def build_mask(spec: MaskSpec, anchors, keep, compiled: bool):
    """(mask, seconds, error): the compiled builder if asked and working, else the uncompiled one."""
    t0 = time.perf_counter()
    if compiled:
        try:
            return flex_block_mask(spec, anchors, keep, compiled=True), time.perf_counter() - t0, None
        except Exception as e:  # noqa: BLE001 - reported, then measured with the fallback below
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
            return flex_block_mask(spec, anchors, keep, compiled=False), time.perf_counter() - t0, err
    return flex_block_mask(spec, anchors, keep, compiled=False), time.perf_counter() - t0, None


def _attend_flex(q, k, v, mask):
    """The drafter's attention call, flex backend (what training compiles)."""
    return attend(q, k, v, mask, "flex")


def make_step(fn: Callable, qkv, mask, backward: bool, device: torch.device) -> Callable[[], None]:
    """One fwd(+bwd) call, synchronised so wall time is device time."""

    def step() -> None:
        out = fn(*qkv, mask)
        if backward:
            out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def _set_device(device: torch.device) -> None:
    """Make `device` current so kernels and caches land on it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def compile_check(device_name: str, quick: bool, compiled_mask: bool) -> dict:
    """First compiled fwd(+bwd) time, then the train-time health check. Returns figures and errors."""
    device = torch.device(device_name)
    _set_device(device)
    shape = shape_for(device, quick)
    backward = backward_supported(device)
    spec, anchors, keep, qkv = make_inputs(shape, device, requires_grad=backward)
    mask, mask_s, mask_err = build_mask(spec, anchors, keep, compiled_mask)
    step = make_step(torch.compile(_attend_flex), qkv, mask, backward, device)
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    result = {"shape": shape.describe(), "backward": backward, "mask_s": mask_s, "mask_error": mask_err,
              "mask_compiled": compiled_mask and mask_err is None, "compile_s": compile_s,
              "health_error": None, "health": None}
    try:
        report = warm_up_and_check(step, n_warmup=1, n_check=2, expect_compiled_flex=True)
        result["health"] = report.summary()
    except CompileHealthError as e:
        result["health_error"] = str(e)
    return result


def _time_steps(step: Callable[[], None], iters: int) -> float:
    """ms per step over `iters` steps after one untimed step."""
    step()  # warm (the compiled one hits the shared inductor cache; eager allocates)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters * 1e3


def _peak_gib(device: torch.device) -> float | None:
    """Peak allocated GPU memory since the last reset; None on CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def speed_check(device_name: str, quick: bool) -> dict:
    """ms per fwd(+bwd) step, compiled vs eager flex, and their ratio (eager / compiled)."""
    device = torch.device(device_name)
    _set_device(device)
    shape = shape_for(device, quick)
    backward = backward_supported(device)
    spec, anchors, keep, qkv = make_inputs(shape, device, requires_grad=backward)
    mask, _, _ = build_mask(spec, anchors, keep, compiled=False)  # mask build is not what is timed
    iters = 3 if device.type == "cpu" and quick else 10
    figures = {"shape": shape.describe(), "backward": backward, "iters": iters}
    for name, fn in (("compiled", torch.compile(_attend_flex)), ("eager", _attend_flex)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager path's one-time warning is expected here
            figures[f"{name}_ms"] = _time_steps(make_step(fn, qkv, mask, backward, device), iters)
        figures[f"{name}_peak_gib"] = _peak_gib(device)
    figures["ratio"] = figures["eager_ms"] / figures["compiled_ms"]
    return figures
