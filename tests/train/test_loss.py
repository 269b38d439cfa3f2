import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.train.loss import block_loss, linear_softmax_loss, summarize


def naive_loss(hidden, weight, labels, valid, gamma, teacher_hidden=None):
    """Per-token loop: full logits, F.cross_entropy / KL, weights exp(-(k-1)/gamma)."""
    b, n, block = labels.shape
    h = hidden.view(b, n, block, -1)
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            for k in range(1, block):
                if not valid[i, j, k]:
                    continue
                logits = h[i, j, k] @ weight.T
                if teacher_hidden is None:
                    ce = F.cross_entropy(logits[None], labels[i, j, k][None])
                else:
                    p = (teacher_hidden[i, j, k] @ weight.T).log_softmax(-1)
                    ce = (p.exp() * (p - logits.log_softmax(-1))).sum()
                w = math.exp(-(k - 1) / gamma)
                num = num + w * ce
                den += w
    return num / den


def make_case(seed=0, b=2, n=3, block=5, hdim=8, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n * block, hdim, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hdim, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (b, n, block), generator=gen)
    valid = torch.rand(b, n, block, generator=gen) > 0.3
    valid[:, :, 0] = False
    return hidden, weight, labels, valid


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_loss_and_grad_equal_a_naive_loop(kind, compiled):
    """Eager and torch.compile'd chunks (the GPU training path; on the CPU here, float64) against
    the naive loop; chunk 4 over 24 rows keeps one chunk shape, so one compiled graph."""
    hidden, weight, labels, valid = make_case()
    teacher = torch.randn(2, 3, 5, 8, dtype=torch.float64) if kind == "kl" else None
    stats = block_loss(hidden, weight, labels, valid, gamma=2.0, chunk_tokens=4, teacher_hidden=teacher,
                       compiled=compiled)
    loss = stats.loss_sum / stats.weight_sum
    (grad,) = torch.autograd.grad(loss, hidden)
    ref = naive_loss(hidden, weight, labels, valid, 2.0, teacher)
    (ref_grad,) = torch.autograd.grad(ref, hidden)
    tol = 1e-10 if compiled else 1e-12  # inductor may reorder the float64 sums
    torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)


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
