"""The CPU's few-row linear route of the eval's decoders: a linear of 2..4 rows (a verify of a few tokens, the
drafter's block, its lm_head) computed as `weight @ x.T`, where that makes the target's own forward faster.

Why it exists: on a 2-core AVX-only EPYC (MKL), `x @ weight.T` with 2..4 rows cost 1.7 to 3x the 1-row product and
`weight @ x.T` ~2/3 of it (docs/PERF.md section 6). Why it is measured, not assumed: on an AVX-512 Xeon the routed
4-row verify took 1.45x as long (session 13), and on a later one the widest matmul was faster routed while the whole
bf16 verify was slower (session 23, PERF 6.y). So `few_row_mode` routes only where `few_rows_pay_model` timed the
model's own 4-token forward both ways and found the route faster. Training never enters it; on CUDA it is off.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


FEW_ROWS = (2, 4)
"""Row counts for which `few_row_matmul` may beat `F.linear` on the CPU, where `few_rows_pay` measures
that it does. On the 2-core EPYC (AVX, no AVX2; MKL), all 210 SmolLM2 linears, 1 thread: 1 row 196 vs
198 ms (no gain), 2 rows 328 vs 243, 4 rows 362 vs 242, 8 rows 453 vs 451, 32 rows 841 vs 931 (a loss);
on a 2-core AVX-512 Xeon the 4-row verify took 1.45x as long routed (docs/LOG.md, session 13)."""


def few_row_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ weight[N, K].T -> [n, N], computed as (weight @ x.T).T made contiguous: with n of
    2..4, MKL streams the weight once this way round, and packs it first the other way."""
    return (weight @ x.T).T.contiguous()


def few_rows_pay(weight: torch.Tensor, rows: int = FEW_ROWS[1], reps: int = 15) -> bool:
    """Whether `few_row_matmul` beats `F.linear` on this CPU for `rows` rows of `weight`'s shape,
    measured once per shape and dtype (`_few_rows_pay`): the two orders differ by CPU (an AVX-only
    EPYC: 2/3 of the time; an AVX-512 Xeon: 1.5x the time, docs/LOG.md session 13)."""
    return _few_rows_pay(tuple(weight.shape), weight.dtype, rows, reps)


@functools.lru_cache(maxsize=None)
def _few_rows_pay(shape: tuple, dtype: torch.dtype, rows: int, reps: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).to(dtype)
    x = torch.randn(rows, shape[1], generator=gen).to(dtype)

    def best(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x, weight)
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(few_row_matmul) < 0.95 * best(F.linear)


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ weight[N, K].T -> [n, N] in the order this CPU computes faster for n rows (`few_rows_pay`: one
    matmul is the whole work here, so timing it alone decides); elsewhere `x @ weight.T`."""
    if x.device.type == "cpu" and FEW_ROWS[0] <= x.shape[0] <= FEW_ROWS[1] and few_rows_pay(weight, x.shape[0]):
        return few_row_matmul(x, weight)
    return x @ weight.T


def few_row_mode(model, device: torch.device):
    """`few_row_linear` on a CPU where it makes the model's own verify-shaped forward faster, else nothing."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return few_row_linear() if few_rows_pay_model(model) else contextlib.nullcontext()


_MODEL_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def few_rows_pay_model(model, reps: int = 5) -> bool:
    """Whether `few_row_linear` speeds up `model`'s forward of FEW_ROWS[1] tokens on this CPU, measured once per
    model (both ways interleaved, the best of `reps` each) and remembered while it lives.

    The widest linear alone (`few_rows_pay`) is not enough to decide: on a 2-core AVX-512 Xeon the routed
    MLP matmul measured faster alone, yet the whole 4-token verify of SmolLM2 took 1.28-1.36 plain steps
    routed against 1.15-1.20 as is (docs/LOG.md, session 23): the mode's Python hook on every torch call and
    the transposed copies cost more than the matmuls save. Only the model's own forward says which wins."""
    if model not in _MODEL_VERDICTS:
        _MODEL_VERDICTS[model] = _time_forward_both_ways(model, reps)
    return _MODEL_VERDICTS[model]


@torch.no_grad()
def _time_forward_both_ways(model, reps: int) -> bool:
    widest = max((m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)), key=lambda w: w.numel(),
                 default=None)
    if widest is None or not few_rows_pay(widest):  # the matmul itself loses: nothing to gain
        return False
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    ids = torch.randint(0, vocab, (1, FEW_ROWS[1]), generator=torch.Generator().manual_seed(0), device=widest.device)
    routed, plain = [], []
    for _ in range(reps + 1):  # the first round warms both paths up and is dropped
        for mode, times in ((few_row_linear, routed), (contextlib.nullcontext, plain)):
            t0 = time.perf_counter()
            with mode():
                model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - t0)
    return min(routed[1:]) < 0.95 * min(plain[1:])


class few_row_linear(TorchFunctionMode):
    """Within this context, `F.linear` on 2..4 rows of a CPU tensor goes through `few_row_matmul`
    (nn.Linear included, so the HF target's and the drafter's layers too); anything else runs as
    is. A scoped torch-function mode rather than patched modules: outside the context nothing
    changes, and training never enters it. `routed` counts the linears it rerouted."""

    def __init__(self):
        super().__init__()
        self.routed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // max(x.shape[-1], 1)
            if x.device.type == "cpu" and FEW_ROWS[0] <= rows <= FEW_ROWS[1] and x.dim() >= 2:
                self.routed += 1
                out = few_row_matmul(x.reshape(rows, x.shape[-1]), weight)  # [rows, N]
                if bias is not None:
                    out = out + bias
                return out.view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)
