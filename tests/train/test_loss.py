import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.train.loss import CE, LossMix, block_loss, linear_softmax_loss, summarize


def naive_loss(hidden, weight, labels, valid, gamma, teacher_hidden=None, mix=CE):
    """Per-token loop: full logits, F.cross_entropy / torch.log_softmax KL at temperature T (times
    T^2), the teacher's argmax for ce_teacher, weights exp(-(k-1)/gamma)."""
    b, n, block = labels.shape
    h = hidden.view(b, n, block, -1)
    temp = mix.temperature
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            for k in range(1, block):
                if not valid[i, j, k]:
                    continue
                logits = h[i, j, k] @ weight.T
                loss = mix.ce * F.cross_entropy(logits[None], labels[i, j, k][None])
                if mix.needs_teacher:
                    t_logits = teacher_hidden[i, j, k] @ weight.T
                    loss = loss + mix.ce_teacher * F.cross_entropy(logits[None], t_logits.argmax()[None])
                    t_log = torch.log_softmax(t_logits / temp, -1)
                    s_log = torch.log_softmax(logits / temp, -1)
                    loss = loss + mix.kl * temp ** 2 * (t_log.exp() * (t_log - s_log)).sum()
                w = math.exp(-(k - 1) / gamma)
                num = num + w * loss
                den += w
    return num / den


MIXES = {"ce": CE, "ce_teacher": LossMix(ce=0.0, ce_teacher=1.0), "kl": LossMix(ce=0.0, kl=1.0),
         "kl_T2": LossMix(ce=0.0, kl=1.0, temperature=2.0),
         "mix_T0.5": LossMix(ce=0.7, kl=0.3, temperature=0.5),
         "all_three": LossMix(ce=0.2, ce_teacher=0.3, kl=0.5, temperature=1.5)}


def make_case(seed=0, b=2, n=3, block=5, hdim=8, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * block, hdim, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hdim, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (b, n, block), generator=gen)
    valid = torch.rand(b, n, block, generator=gen) > 0.3
    valid[:, :, 0] = False
    return hidden, weight, labels, valid


def _check_against_naive(mix, chunk, compiled, seed=0):
    hidden, weight, labels, valid = make_case(seed)
    teacher = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7)) \
        if mix.needs_teacher else None
    stats = block_loss(hidden, weight, labels, valid, gamma=2.0, chunk_tokens=chunk, teacher_hidden=teacher,
                       compiled=compiled, mix=mix)
    loss = stats.loss_sum / stats.weight_sum
    (grad,) = torch.autograd.grad(loss, hidden)
    ref = naive_loss(hidden, weight, labels, valid, 2.0, teacher, mix)
    (ref_grad,) = torch.autograd.grad(ref, hidden)
    tol = 1e-10 if compiled else 1e-12  # inductor may reorder the float64 sums
    torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("chunk", [1, 4, 7, 10_000])
@pytest.mark.parametrize("kind", list(MIXES))
def test_loss_and_grad_equal_a_naive_loop(kind, chunk):
    """Eager chunks against the naive float64 loop, values and gradients, at several chunk sizes
    (24 rows: one row, an even split, a ragged last chunk, one chunk)."""
    _check_against_naive(MIXES[kind], chunk, compiled=False)


@pytest.mark.parametrize("kind", ["ce", "kl_T2", "all_three"])
def test_compiled_chunks_equal_a_naive_loop(kind):
    """The torch.compile'd chunks (the GPU training path: `fused_ce_rows` / `fused_mix_rows`; on the
    CPU here, float64); chunk 4 over 24 rows keeps one chunk shape, so one compiled graph."""
    _check_against_naive(MIXES[kind], 4, compiled=True)


def test_chunked_equals_unchunked():
    hidden, weight, labels, _ = make_case(seed=1)
    a, pa = linear_softmax_loss(hidden.reshape(-1, 8), weight, labels.reshape(-1), chunk=3)
    b, pb = linear_softmax_loss(hidden.reshape(-1, 8), weight, labels.reshape(-1), chunk=10_000)
    torch.testing.assert_close(a, b)
    assert torch.equal(pa, pb)
    ga, = torch.autograd.grad(a.sum(), hidden)
    gb, = torch.autograd.grad(b.sum(), hidden)
    torch.testing.assert_close(ga, gb)


def test_stats_give_per_slot_accuracy_and_simulated_tau():
    # vocab 3, hidden = one-hot logits so the argmax is chosen by hand
    weight = torch.eye(3, dtype=torch.float64)
    block = 4
    labels = torch.tensor([[[0, 1, 2, 0], [0, 2, 2, 2]]])
    preds = torch.tensor([[[0, 1, 2, 1], [0, 2, 0, 2]]])  # block 0: 2 right then wrong; block 1: 1 right
    hidden = F.one_hot(preds, 3).double().view(1, 2 * block, 3) * 5
    valid = torch.ones(1, 2, block, dtype=torch.bool)
    valid[:, :, 0] = False
    s = summarize(block_loss(hidden, weight, labels, valid, gamma=4.0))
    assert s["acc"] == [1.0, 0.5, 0.5]
    assert s["sim_tau"] == pytest.approx(1 + (2 + 1) / 2)
    assert s["eal"] == pytest.approx(1 + 1.0 + 0.5 + 0.25)
