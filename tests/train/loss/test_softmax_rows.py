"""The chunked loss compiled (train/loss/softmax_rows.py `compiled_chunk`, the GPU training path) keeps
every [rows, vocab] tensor inside its compiled graph: profiled on the CPU at a small shape, no aten
op outside the compiled region reads or allocates a chunk of logits, for every loss kind, both
position weightings, every head's extras (DFlash 2's top-k, DSpark's low-rank bias), a target logit
transform and the float8 lm_head; and its results equal the eager path's. The eager path itself is
the check that the detector can fail (it runs those ops outside any compiled region). Values and
gradients against naive loops: tests/train/loss/test_loss.py."""

import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dflash_train.model.target.logits import LogitTransform
from dflash_train.train.loss.row_weights import RowWeights
from dflash_train.train.loss.softmax_rows import LossMix, LowRankBias, RowsSpec, linear_softmax_loss

V, H, R, ROWS, CHUNK, D = 512, 32, 4, 96, 48, 8
LOGITS = CHUNK * V  # elements of one chunk's logits; the weight [V, H] and bias weight [V, R] are smaller
COMPILED_REGION = "Torch-Compiled Region"

CASES = {  # name: (mix, weighting, top-k, bias, transform)
    "dflash-ce-decay": (LossMix(), "decay", 0, False, LogitTransform()),
    "dflash-ce_teacher-dpace": (LossMix(ce=0.0, ce_teacher=1.0), "dpace", 0, False, LogitTransform()),
    "dflash2-kl-T2-dpace-topk": (LossMix(ce=0.0, kl=1.0, temperature=2.0), "dpace", 4, False, LogitTransform()),
    "dflash-mix-softcap-decay": (LossMix(ce=0.7, kl=0.3), "decay", 0, False, LogitTransform(0.7, 3.0)),
    "dspark-tv-dpace-bias": (LossMix(ce=0.1, tv=0.9), "dpace", 0, True, LogitTransform()),
    "dspark-kl-decay-bias": (LossMix(ce=0.0, kl=1.0), "decay", 0, True, LogitTransform()),
}


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """Earlier tests compile the same chunk function at other shapes and specs; past dynamo's recompile
    limit it would run eagerly, which is what this file detects, so each test starts from an empty cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _problem(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    teacher = torch.randn(ROWS, H, generator=g).to(dtype)
    labels = torch.randint(0, V, (ROWS,), generator=g)
    valid = torch.rand(ROWS, generator=g) > 0.2
    e = (torch.randn(ROWS, R, generator=g) * 0.5).to(dtype).requires_grad_(True)
    m = (torch.randn(V, R, generator=g) * 0.5).to(dtype).requires_grad_(True)
    return hidden, weight, teacher, labels, valid, e, m


def _runner(case: str, compiled: bool, fp8: bool = False):
    mix, weighting, topk, with_bias, transform = CASES[case]
    dtype = torch.bfloat16 if fp8 else torch.float32
    hidden, weight, teacher, labels, valid, e, m = _problem(dtype)
    spec = RowsSpec(mix, transform, topk, RowWeights(weighting, D, 3.0, 0.5))
    head8 = None
    if fp8:
        from dflash_train.fp8 import float8_head

        head8 = float8_head(weight)
    inputs = [hidden, e, m] if with_bias else [hidden]

    def run():
        out = linear_softmax_loss(hidden, weight, labels, teacher, CHUNK, compiled, spec, head8,
                                  LowRankBias(e, m) if with_bias else None, valid)
        grads = torch.autograd.grad(out.loss_sum, inputs)
        return out, grads
    return run


def _outside_ops(run) -> list[str]:
    """aten ops outside any compiled region that read or allocate at least a chunk of logits."""
    run()  # compiles (or warms up the eager path)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        run()
    found = []
    for event in prof.events():
        if not event.name.startswith("aten::") or _inside_compiled(event):
            continue
        largest_input = max([_numel(shape) for shape in event.input_shapes or []] or [0])
        if largest_input >= LOGITS or event.cpu_memory_usage >= LOGITS * 2:  # 2 bytes: even a bf16 copy
            found.append(f"{event.name} inputs {event.input_shapes} allocates {event.cpu_memory_usage} B")
    return found


def _inside_compiled(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(COMPILED_REGION):
            return True
        parent = parent.cpu_parent
    return False


def _numel(shape) -> int:
    n = 1
    for size in shape if isinstance(shape, (list, tuple)) else []:
        n *= size if isinstance(size, int) else 1
    return n if shape else 0


@pytest.mark.parametrize("case", list(CASES))
def test_no_eager_op_over_a_chunk_of_logits_outside_the_compiled_chunk(case):
    """Forward and backward of the compiled loss: every op over [chunk, V] runs inside the compiled
    graph. The eager twin of the same call shows such ops (so the detector works) and the same
    numbers (float32: compiled kernels reorder sums)."""
    compiled_run, eager_run = _runner(case, compiled=True), _runner(case, compiled=False)
    assert _outside_ops(compiled_run) == []
    assert len(_outside_ops(eager_run)) >= 3
    (got, got_grads), (want, want_grads) = compiled_run(), eager_run()
    for name in ("losses", "weights", "label_logprob", "tv", "label_logit", "loss_sum", "topk_values"):
        if getattr(want, name) is not None:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=2e-5, atol=2e-5)
    assert torch.equal(got.argmax, want.argmax)
    if want.topk_ids is not None:
        assert torch.equal(got.topk_ids, want.topk_ids)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert b.abs().sum() > 0


@pytest.mark.parametrize("case", ["dflash-ce-decay", "dspark-tv-dpace-bias"])
def test_the_float8_lm_head_keeps_its_scaling_inside_the_compiled_chunk(case):
    """With the fp8 lm_head the gradient logits' e5m2 scaling and cast (torchao's dynamic cast: an
    amax over the chunk, a scale, a clamp) run inside the compiled graph too; the results stay within
    float8 rounding of the eager float8 path. torch >= 2.13 runs float8 matmuls on the CPU."""
    pytest.importorskip("torchao", reason="the fp8 extra (torchao) is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled_run, eager_run = _runner(case, compiled=True, fp8=True), _runner(case, compiled=False, fp8=True)
        assert _outside_ops(compiled_run) == []
        assert len(_outside_ops(eager_run)) >= 3
        (got, got_grads), (want, want_grads) = compiled_run(), eager_run()
    torch.testing.assert_close(got.loss_sum.float(), want.loss_sum.float(), rtol=1e-2, atol=1e-2)
    for a, b in zip(got_grads, want_grads):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.05
