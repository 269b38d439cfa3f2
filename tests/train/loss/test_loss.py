import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.train.loss.objective import CE, LossMix, Objective, block_loss, linear_softmax_loss, summarize
from dflash_train.train.loss.softmax_rows import RowsSpec


def dflash_block_loss(hidden, weight, labels, valid, gamma, chunk_tokens=2048, teacher_hidden=None, compiled=False,
                      mix=CE, weighting="decay", alpha=0.5):
    """`block_loss` in DFlash's block layout: hidden [b, N*B, H], labels / valid [b, N, B] and teacher
    [b, N, B, H] with slot 0 the (never predicted) anchor."""
    b, n, block = labels.shape
    rows = hidden.view(b, n, block, -1)[:, :, 1:]
    teacher = None if teacher_hidden is None else teacher_hidden[:, :, 1:]
    objective = Objective(RowsSpec(mix), weighting, gamma, alpha, chunk_tokens, compiled)
    return block_loss(rows, weight, labels[:, :, 1:], valid[:, :, 1:], objective, teacher)


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
    stats = dflash_block_loss(hidden, weight, labels, valid, gamma=2.0, chunk_tokens=chunk, teacher_hidden=teacher,
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
    a = linear_softmax_loss(hidden.reshape(-1, 8), weight, labels.reshape(-1), chunk=3)
    b = linear_softmax_loss(hidden.reshape(-1, 8), weight, labels.reshape(-1), chunk=10_000)
    torch.testing.assert_close(a.losses, b.losses)
    torch.testing.assert_close(a.loss_sum, b.loss_sum)
    assert torch.equal(a.argmax, b.argmax)
    ga, = torch.autograd.grad(a.loss_sum, hidden)
    gb, = torch.autograd.grad(b.loss_sum, hidden)
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
    s = summarize(dflash_block_loss(hidden, weight, labels, valid, gamma=4.0))
    assert s["acc"] == [1.0, 0.5, 0.5]
    assert s["sim_tau"] == pytest.approx(1 + (2 + 1) / 2)
    assert s["eal"] == pytest.approx(1 + 1.0 + 0.5 + 0.25)


def naive_dpace_loss(hidden, weight, labels, valid, alpha, mix=CE, teacher_hidden=None, transform=None):
    """D-PACE written as plain loops (arXiv 2605.18810, eq. 7-8): per block, q_i = p(data token) under
    no_grad, q~_i = (1 - alpha) q_i + alpha (1 where invalid), C_i = prod q~, w_i = sum_{m >= i} C_m
    valid_m; loss = sum w l / sum w over the drafted slots 1..B-1."""
    b, n, block = labels.shape
    h = hidden.view(b, n, block, -1)
    num = den = 0.0
    for i in range(b):
        for j in range(n):
            losses, qs = [], []
            for k in range(1, block):
                logits = h[i, j, k] @ weight.T
                if transform is not None:
                    logits = transform(logits)
                log_p = torch.log_softmax(logits, -1)
                loss = -mix.ce * log_p[labels[i, j, k]]
                if mix.needs_teacher:
                    t_logits = teacher_hidden[i, j, k] @ weight.T
                    if transform is not None:
                        t_logits = transform(t_logits)
                    p_t = torch.softmax(t_logits, -1)
                    loss = loss + mix.tv * 0.5 * (log_p.exp() - p_t).abs().sum()
                losses.append(loss)
                qs.append(float(log_p[labels[i, j, k]].exp()) if valid[i, j, k] else None)
            cum, c = [], 1.0
            for q in qs:
                c *= 1.0 if q is None else (1 - alpha) * q + alpha
                cum.append(0.0 if q is None else c)
            for k, loss in enumerate(losses):
                if qs[k] is None:
                    continue
                w = sum(cum[k:])
                num = num + w * loss
                den += w
    return num / den


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.3])
def test_dpace_loss_and_grad_equal_a_naive_loop(alpha, compiled):
    """D-PACE weights from the forward's own confidences, normalised by their sum: value and gradient
    equal the float64 loop (alpha 1 gives q-independent weights, a distinct case), eager and compiled."""
    hidden, weight, labels, valid = make_case(seed=11)
    stats = dflash_block_loss(hidden, weight, labels, valid, gamma=2.0, chunk_tokens=4, compiled=compiled,
                              weighting="dpace", alpha=alpha)
    loss = stats.loss_sum / stats.weight_sum
    ref = naive_dpace_loss(hidden, weight, labels, valid, alpha)
    (grad,), (ref_grad,) = torch.autograd.grad(loss, hidden), torch.autograd.grad(ref, hidden)
    tol = 1e-10 if compiled else 1e-12
    torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)
    decay = dflash_block_loss(hidden, weight, labels, valid, gamma=2.0)
    assert not torch.allclose(loss, decay.loss_sum / decay.weight_sum)  # not the decay in disguise


def test_dpace_weights_favour_slots_after_confident_ones():
    """The weight of slot i counts the expected run after it: an early confident slot raises the
    weights of the slots it leads to, and an invalid slot ends nothing (its q~ is 1)."""
    from dflash_train.train.loss.objective import dpace_weights

    logq = torch.log(torch.tensor([[[0.9, 0.9, 0.9], [0.1, 0.9, 0.9]]], dtype=torch.float64))
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    w = dpace_weights(logq, valid, alpha=0.5)
    assert (w[0, 0] > w[0, 1]).all()  # the first block's prefix is likelier to be accepted
    assert w[0, 0, 0] == pytest.approx(0.95 + 0.95 ** 2 + 0.95 ** 3)
    valid[0, 0, 1] = False
    w2 = dpace_weights(logq, valid, alpha=0.5)
    assert w2[0, 0, 1] == 0 and w2[0, 0, 2] == pytest.approx(0.95 ** 2)


@pytest.mark.parametrize("compiled", [False, True])
def test_tv_term_and_a_soft_capped_multiplied_head_equal_a_naive_loop(compiled):
    """DSpark's 0.1 CE + 0.9 TV against the target's distribution, through a target that multiplies
    and soft-caps its logits (Gemma 2 style): values and gradients equal the loop, D-PACE weighted."""
    from dflash_train.model.target.logits import LogitTransform

    hidden, weight, labels, valid = make_case(seed=12)
    teacher = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    transform = LogitTransform(multiplier=0.7, softcap=3.0)
    mix = LossMix(ce=0.1, tv=0.9)
    b, n, block = labels.shape
    objective = Objective(RowsSpec(mix, transform), "dpace", 2.0, 0.5, 4, compiled)
    stats = block_loss(hidden.view(b, n, block, -1)[:, :, 1:], weight, labels[:, :, 1:], valid[:, :, 1:], objective,
                       teacher[:, :, 1:])
    loss = stats.loss_sum / stats.weight_sum
    ref = naive_dpace_loss(hidden, weight, labels, valid, 0.5, mix, teacher, transform)
    (grad,), (ref_grad,) = torch.autograd.grad(loss, hidden), torch.autograd.grad(ref, hidden)
    tol = 1e-10 if compiled else 1e-12
    torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_trainable_low_rank_bias_gets_exact_gradients_under_row_weights(weighting, compiled):
    """logits = h W^T + e M^T with e and M trainable (DSpark's Markov bias): the gradients of hidden, e
    and M, all built in the forward with each row's weight (D-PACE's from the forward's own
    confidences), equal autograd's on full logits, in 3 chunks of whole blocks."""
    from dflash_train.train.loss.objective import position_weights
    from dflash_train.train.loss.row_weights import RowWeights
    from dflash_train.train.loss.softmax_rows import LowRankBias

    g = torch.Generator().manual_seed(14)
    hidden = torch.randn(12, 6, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(13, 6, dtype=torch.float64, generator=g)
    e = torch.randn(12, 3, dtype=torch.float64, generator=g, requires_grad=True)
    m = torch.randn(13, 3, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (12,), generator=g)
    valid = torch.rand(12, generator=g) > 0.25
    spec = RowsSpec(weights=RowWeights(weighting, 4, 2.0, 0.5))
    out = linear_softmax_loss(hidden, weight, labels, chunk=5, bias=LowRankBias(e, m), spec=spec, valid=valid,
                              compiled=compiled)
    got = torch.autograd.grad(out.loss_sum, (hidden, e, m))
    ref_losses = F.cross_entropy(hidden @ weight.T + e @ m.T, labels, reduction="none")
    row_w = position_weights(weighting, -ref_losses.detach().view(3, 4), valid.view(3, 4), 2.0, 0.5).view(-1)
    want = torch.autograd.grad((ref_losses * row_w).sum(), (hidden, e, m))
    tol = 1e-10 if compiled else 1e-12
    torch.testing.assert_close(out.losses, ref_losses.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.weights, row_w, rtol=tol, atol=tol)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert all(x.abs().sum() > 0 for x in got)


def test_rows_report_confidence_top_k_and_label_logit():
    """Per row: log p(label), the top-k of the logits and the label's logit, none of them carrying
    a gradient (D-PACE's confidences, DFlash 2's candidates)."""
    hidden, weight, labels, _ = make_case(seed=15)
    rows, flat_labels = hidden.reshape(-1, 8), labels.reshape(-1)
    out = linear_softmax_loss(rows, weight, flat_labels, chunk=5, spec=RowsSpec(topk=3))
    logits = (rows @ weight.T).detach()
    torch.testing.assert_close(out.label_logprob, logits.log_softmax(-1).gather(1, flat_labels[:, None])[:, 0])
    torch.testing.assert_close(out.label_logit, logits.gather(1, flat_labels[:, None])[:, 0])
    top = logits.topk(3, -1)
    torch.testing.assert_close(out.topk_values, top.values)
    assert torch.equal(out.topk_ids, top.indices)
    assert not out.label_logprob.requires_grad and not out.losses.requires_grad and out.loss_sum.requires_grad
