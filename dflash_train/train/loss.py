"""The DFlash training objective: position-weighted block cross-entropy, computed in chunks.

For block j with anchor a_j and slot k = 1..B-1 (slot 0 is the anchor and is never predicted):
    label[j, k]  = input_ids[a_j + k]                       (kind="ce", the paper's data token)
                 = argmax target logits at a_j + k - 1      (kind="ce_teacher")
    teacher      = softmax target logits at a_j + k - 1     (kind="kl": KL(teacher || drafter))
    w_k          = exp(-(k - 1) / gamma)                    (paper eq. 4)
    loss         = sum_{j,k} w_k * valid[j,k] * ce[j,k] / sum_{j,k} w_k * valid[j,k]

The normaliser is the weight sum over the *global* batch (every micro-batch on every drafter
rank), which the caller divides by, so a step's gradient does not depend on how the batch is split
across ranks and micro-batches (SpecForge normalises per rank; we normalise globally so that
1 process and N processes train identically).

Memory: the lm_head and the loss run `chunk_tokens` rows at a time inside one autograd Function
that computes dLoss/dHidden in its forward; the full [N*(B-1), V] logits never exist. Peak extra
memory is about chunk_tokens * V * 6 bytes eagerly (fp32 logits, reused in place for the softmax,
plus one copy in the weight dtype for the gradient matmul): 1.9 GB at chunk 2048, V = 151936;
compiled, the logits and the gradient logits stay in the weight dtype (4 bytes per entry in bf16).
The saved state for backward is one gradient the size of the hidden input.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch


UNDERFLOW_CLAMP = -80.0  # exp() below e^-87 yields float32 subnormals: ~60x slower on CPU


def _shifted_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits - rowmax, log sum exp of that), the shifted logits clamped below at -80.

    The clamp changes nothing a float32 softmax can represent (e^-80 < 2e-35 of the largest
    term) but keeps exp() off the subnormal slow path. The label's logit is read before any use,
    from the clamped tensor; a label 80 nats below the best token saturates the loss at ~80 + log V
    with the correct gradient direction (softmax - onehot).
    """
    shifted = (logits - logits.amax(-1, keepdim=True)).clamp_(min=UNDERFLOW_CLAMP)  # [c, V]
    return shifted, shifted.exp().sum(-1, keepdim=True).log()  # [c, V], [c, 1]


def softmax_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                 teacher: torch.Tensor | None, want_grad: bool):
    """One chunk of rows, eager (CPU-safe): (loss [c], argmax [c], d loss / d hidden [c, H] or None).

    Each pass reads and writes the whole chunk of float32 logits; the clamp in `_shifted_logits`
    keeps exp() off the CPU's subnormal slow path. `fused_ce_rows` is the compiled (GPU) twin.
    """
    acc = torch.promote_types(weight.dtype, torch.float32)  # softmax in >= float32
    logits = (hidden @ weight.T).to(acc)  # [c, V]
    argmax = logits.argmax(-1)
    shifted, log_norm = _shifted_logits(logits)  # log_softmax = shifted - log_norm
    if teacher is None:
        target = labels[:, None]
        losses = (log_norm - shifted.gather(1, target)).squeeze(1)
    else:
        t_shifted, t_norm = _shifted_logits((teacher.to(weight.dtype) @ weight.T).to(acc))
        t_prob = (t_shifted - t_norm).exp_()
        losses = (t_prob * ((t_shifted - t_norm) - (shifted - log_norm))).sum(-1)
    if not want_grad:
        return losses, argmax, None
    d_logits = shifted.sub_(log_norm).exp_()  # softmax, in place
    if teacher is None:
        d_logits.scatter_add_(1, target, torch.full_like(target, -1.0, dtype=d_logits.dtype))
    else:
        d_logits.sub_(t_prob)
    return losses, argmax, d_logits.to(weight.dtype) @ weight  # [c, H]


def fused_ce_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, want_grad: bool):
    """The cross-entropy of `softmax_rows` written for inductor: same results, fewer passes.

    `log_softmax` lowers to one online (max, sum-exp) reduction over the logits in the matmul's
    dtype; the label's log-probability is a gather, and softmax - onehot is one pointwise kernel
    that writes the gradient logits in the weight dtype. No float32 [c, V] tensor is written.
    The hand-written max/clamp/exp chain of `_shifted_logits` defeats that fusion (two or three
    passes over float32 logits), and the clamp only matters on CPUs.
    """
    logits = hidden @ weight.T  # [c, V], weight dtype
    log_probs = logits.to(torch.promote_types(weight.dtype, torch.float32)).log_softmax(-1)  # fused away
    losses = -log_probs.gather(1, labels[:, None]).squeeze(1)
    argmax = logits.argmax(-1)
    if not want_grad:
        return losses, argmax, None
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    d_logits = log_probs.exp() - (vocab == labels[:, None]).to(log_probs.dtype)  # softmax - onehot
    return losses, argmax, d_logits.to(weight.dtype) @ weight  # [c, H]


def _rows_fused(hidden, weight, labels, teacher, want_grad):
    """Compiled entry point: the fused cross-entropy, or the generic path for a teacher (KL)."""
    if teacher is None:
        return fused_ce_rows(hidden, weight, labels, want_grad)
    return softmax_rows(hidden, weight, labels, teacher, want_grad)


@functools.lru_cache(maxsize=None)
def compiled_softmax_rows():
    """The chunk function compiled once per process (static shapes: one graph per chunk shape)."""
    return torch.compile(_rows_fused, dynamic=False)


class _LinearSoftmaxLoss(torch.autograd.Function):
    """Per-row loss of logits = hidden @ weight.T against a label (CE) or a teacher (KL).

    forward(hidden [T, H], weight [V, H], labels [T] | None, teacher [T, H] | None, chunk, compiled)
      -> loss [T] (float32, or float64 for float64 inputs), argmax [T]
    The weight is frozen (no gradient); the gradient w.r.t. hidden is built chunk by chunk in
    the forward pass: d loss / d logits = softmax(logits) - target_distribution.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, chunk: int, compiled: bool):
        hidden = hidden.to(weight.dtype)
        rows = hidden.shape[0]
        losses = hidden.new_empty(rows, dtype=torch.promote_types(weight.dtype, torch.float32))
        argmax = torch.empty(rows, dtype=torch.long, device=hidden.device)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if want_grad else None
        rows_fn = compiled_softmax_rows() if compiled else softmax_rows
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            part = slice(start, end)
            loss, top, d_hidden = rows_fn(hidden[part], weight, None if labels is None else labels[part],
                                          None if teacher is None else teacher[part], want_grad)
            losses[part], argmax[part] = loss, top
            if want_grad:
                grad[part] = d_hidden
        ctx.mark_non_differentiable(argmax)
        if want_grad:
            ctx.save_for_backward(grad)
        return losses, argmax

    @staticmethod
    def backward(ctx, grad_losses, grad_argmax):
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None, None


def linear_softmax_loss(hidden, weight, labels=None, teacher=None, chunk: int = 2048, compiled: bool = False):
    """Chunked lm_head + CE (labels) or KL (teacher hidden, already final-normed) per row.

    compiled=True runs each chunk through `compiled_softmax_rows` (GPU training: fused passes)."""
    if (labels is None) == (teacher is None):
        raise ValueError("give exactly one of labels (cross-entropy) or teacher (KL)")
    return _LinearSoftmaxLoss.apply(hidden, weight, labels, teacher, chunk, compiled)


def slot_weights(block_size: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """w_k for slots 1..B-1: exp(-(k-1)/gamma), shape [B-1]."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float64)
    return torch.exp(-(k - 1) / gamma).to(dtype)


@dataclass
class LossStats:
    """Sums and counts of one batch; reduced across ranks by summing, divided only at the end.

    Per-slot tensors have B-1 entries, for slots 1..B-1.
    """

    loss_sum: torch.Tensor  # sum of w * ce over valid slots (the objective's numerator)
    weight_sum: torch.Tensor  # sum of w over valid slots (its denominator)
    slot_loss_sum: torch.Tensor  # [B-1] unweighted ce summed per slot
    slot_correct: torch.Tensor  # [B-1] argmax == label, valid slots
    slot_count: torch.Tensor  # [B-1] valid slots
    accepted_sum: torch.Tensor  # sum over blocks of leading correct slots (greedy acceptance)
    block_count: torch.Tensor  # blocks with at least slot 1 valid

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def detach(self) -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name).detach() for f in fields(self)})

    def flat(self) -> torch.Tensor:
        return torch.cat([getattr(self, f.name).float().reshape(-1) for f in fields(self)])

    @classmethod
    def from_flat(cls, flat: torch.Tensor, block_size: int) -> "LossStats":
        values, offset = {}, 0
        for f in fields(cls):
            size = block_size - 1 if f.name.startswith("slot_") else 1
            part = flat[offset: offset + size]
            values[f.name] = part if f.name.startswith("slot_") else part.reshape(())
            offset += size
        return cls(**values)


def block_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
               gamma: float, chunk_tokens: int = 2048, teacher_hidden: torch.Tensor | None = None,
               compiled: bool = False) -> LossStats:
    """Loss sums for drafter outputs hidden [b, N*B, H] against labels/valid [b, N, B].

    teacher_hidden [b, N, B, H] (final-normed target hidden at a + k - 1) switches to KL; for
    ce_teacher pass the teacher argmax as `labels` instead.
    """
    b, n, block = labels.shape
    h = hidden.view(b, n, block, -1)[:, :, 1:]  # [b, N, B-1, H]: slot 0 is never predicted
    lab = labels[:, :, 1:]
    ok = valid[:, :, 1:]
    teacher = None if teacher_hidden is None else teacher_hidden[:, :, 1:].reshape(-1, h.shape[-1])
    losses, argmax = linear_softmax_loss(h.reshape(-1, h.shape[-1]), lm_head_weight,
                                         None if teacher is not None else lab.reshape(-1), teacher, chunk_tokens,
                                         compiled)
    losses = losses.view(b, n, block - 1)
    okf = ok.to(losses.dtype)
    w = slot_weights(block, gamma, hidden.device, losses.dtype) * okf  # [b, N, B-1]
    correct = (argmax.view_as(lab) == lab) & ok
    accepted = torch.cumprod(correct.long(), dim=-1).sum(-1)  # [b, N] leading correct slots
    return LossStats(
        loss_sum=(w * losses).sum(),
        weight_sum=w.sum(),
        slot_loss_sum=(losses * okf).sum((0, 1)).detach(),
        slot_correct=correct.sum((0, 1)).float(),
        slot_count=okf.sum((0, 1)),
        accepted_sum=accepted.sum().float(),
        block_count=ok[:, :, 0].sum().float(),
    )


def summarize(stats: LossStats) -> dict:
    """Python floats from (reduced) sums: loss, per-slot accuracy, simulated tau. One host sync."""
    flat = stats.flat().tolist()
    s = LossStats.from_flat(torch.tensor(flat), stats.slot_count.numel() + 1)
    count = s.slot_count.clamp(min=1)
    acc = (s.slot_correct / count).tolist()
    return {
        "loss": float(s.loss_sum / max(float(s.weight_sum), 1e-9)),
        "acc": acc,
        "ce": (s.slot_loss_sum / count).tolist(),
        "sim_tau": 1.0 + float(s.accepted_sum) / max(float(s.block_count), 1.0),
        "eal": 1.0 + sum(math.prod(acc[: i + 1]) for i in range(len(acc))),
        "blocks": float(s.block_count),
    }
