"""The DFlash training objective: position-weighted block losses, computed in chunks.

For block j with anchor a_j and slot k = 1..B-1 (slot 0 is the anchor and is never predicted), with
s = drafter logits of the slot and t = target logits at position a_j + k - 1 (the target's
prediction of token a_j + k: `teacher_hidden_at`), the per-slot loss is the `LossMix`
    l[j,k] = c_ce * CE(s, input_ids[a_j + k])        ("ce": the paper's data token)
           + c_ct * CE(s, argmax t)                  ("ce_teacher")
           + c_kl * T^2 * KL(softmax(t/T) || softmax(s/T))   ("kl", temperature T; Hinton's T^2
                                                       keeps the gradient scale of T = 1)
    w_k    = exp(-(k - 1) / gamma)                   (paper eq. 4)
    loss   = sum_{j,k} w_k * valid[j,k] * l[j,k] / sum_{j,k} w_k * valid[j,k]
`LossMix.from_config` maps loss.kind (ce | ce_teacher | kl | mix) to the coefficients; mix is
(1 - kl_weight) * ce + kl_weight * kl. Accuracy and simulated tau always compare the drafter's
argmax with the DATA token: that is acceptance under greedy verification, and on regenerated data
the target's greedy token is the data token.

The normaliser is the weight sum over the *global* batch (every micro-batch on every drafter
rank), which the caller divides by, so a step's gradient does not depend on how the batch is split
across ranks and micro-batches (SpecForge normalises per rank; we normalise globally so that
1 process and N processes train identically).

Memory: the lm_head and the loss run `chunk_tokens` rows at a time inside one autograd Function
that computes dLoss/dHidden in its forward; neither the drafter's nor the target's full
[N*(B-1), V] logits ever exist. Peak extra memory for CE is about chunk_tokens * V * 6 bytes
eagerly (fp32 logits, reused in place for the softmax, plus one copy in the weight dtype for the
gradient matmul): 1.9 GB at chunk 2048, V = 151936; compiled, the logits and the gradient logits
stay in the weight dtype (4 bytes per entry in bf16). A teacher adds its logits and probabilities
(about 2-3x the CE figure eagerly; less compiled): the same chunk bound, lower loss.chunk_tokens
for the same peak. The saved state for backward is one gradient the size of the hidden input.

With `loss.train_vocab` (train/vocab.py) the softmaxes, the KL and the teacher's argmax run over
the subset's rows only: the teacher is renormalised over the subset. An approximation wherever the
target puts mass outside the subset (that mass is neither matched nor pushed down); held-out
simulated tau always uses the full vocabulary.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import torch

from dflash_train.fp8 import float8_mm

UNDERFLOW_CLAMP = -80.0  # exp() below e^-87 yields float32 subnormals: ~60x slower on CPU


@dataclass(frozen=True)
class LossMix:
    """Coefficients of the per-slot loss (module doc): data-token CE, teacher-argmax CE, KL at T."""

    ce: float = 1.0
    ce_teacher: float = 0.0
    kl: float = 0.0
    temperature: float = 1.0

    @property
    def needs_teacher(self) -> bool:
        return self.ce_teacher != 0 or self.kl != 0

    @classmethod
    def from_config(cls, loss_cfg) -> "LossMix":
        """The mix of config.LossConfig (kind, temperature, kl_weight)."""
        temperature = float(loss_cfg.temperature)
        return {"ce": cls(),
                "ce_teacher": cls(ce=0.0, ce_teacher=1.0),
                "kl": cls(ce=0.0, kl=1.0, temperature=temperature),
                "mix": cls(ce=1.0 - loss_cfg.kl_weight, kl=float(loss_cfg.kl_weight), temperature=temperature),
                }[loss_cfg.kind]


CE = LossMix()


def _log_softmax_clamped(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of float32+ logits [c, V], the shifted logits clamped below at -80, in place.

    The clamp changes nothing a float32 softmax can represent (e^-80 < 2e-35 of the largest
    term) but keeps exp() off the subnormal slow path. A label 80 nats below the best token
    saturates the loss at ~80 + log V with the correct gradient direction (softmax - onehot).
    """
    shifted = logits.sub_(logits.amax(-1, keepdim=True)).clamp_(min=UNDERFLOW_CLAMP)  # [c, V]
    return shifted.sub_(shifted.exp().sum(-1, keepdim=True).log())


def _picked(log_probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return log_probs.gather(1, index[:, None]).squeeze(1)  # [c]


def softmax_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                 teacher: torch.Tensor | None, want_grad: bool, mix: LossMix = CE):
    """One chunk of rows, eager (CPU-safe): (loss [c], argmax [c], d loss / d hidden [c, H] or None).

    Each pass reads and writes the whole chunk of float32 logits; the clamp in
    `_log_softmax_clamped` keeps exp() off the CPU's subnormal slow path. `fused_ce_rows` and
    `fused_mix_rows` are the compiled (GPU) twins.
    """
    acc = torch.promote_types(weight.dtype, torch.float32)  # softmax in >= float32
    logits = (hidden @ weight.T).to(acc)  # [c, V]
    argmax = logits.argmax(-1)
    temp = mix.temperature
    s_log_t = _log_softmax_clamped(logits / temp) if mix.kl and temp != 1 else None  # drafter at T
    log_probs = _log_softmax_clamped(logits)  # [c, V], in place: `logits` is gone
    losses = torch.zeros_like(argmax, dtype=acc)
    if mix.ce:
        losses -= mix.ce * _picked(log_probs, labels)
    t_argmax = t_prob = None
    if mix.needs_teacher:
        t_logits = (teacher.to(weight.dtype) @ weight.T).to(acc)  # [c, V]
        t_argmax = t_logits.argmax(-1)
        if mix.ce_teacher:
            losses -= mix.ce_teacher * _picked(log_probs, t_argmax)
        if mix.kl:
            t_log = _log_softmax_clamped(t_logits / temp if temp != 1 else t_logits)  # [c, V]
            t_prob = t_log.exp()
            s_log = log_probs if s_log_t is None else s_log_t
            losses += (mix.kl * temp * temp) * (t_prob * t_log.sub_(s_log)).sum(-1)
    if not want_grad:
        return losses, argmax, None
    return losses, argmax, _d_logits(log_probs, s_log_t, t_prob, labels, t_argmax, mix).to(weight.dtype) @ weight


def _d_logits(log_probs, s_log_t, t_prob, labels, t_argmax, mix: LossMix) -> torch.Tensor:
    """d loss / d logits [c, V], in place over `log_probs`:
    (c_ce + c_ct) softmax(s) - c_ce onehot(label) - c_ct onehot(argmax t) + c_kl T (softmax(s/T) - softmax(t/T))."""
    hard = mix.ce + mix.ce_teacher
    d = log_probs.exp_()  # softmax(s)
    if mix.kl and s_log_t is None:  # T = 1: softmax(s/T) is softmax(s)
        d.mul_(hard + mix.kl).sub_(t_prob, alpha=mix.kl)
    else:
        d.mul_(hard)
        if mix.kl:
            d.add_(s_log_t.exp_().sub_(t_prob), alpha=mix.kl * mix.temperature)
    for coef, index in ((mix.ce, labels), (mix.ce_teacher, t_argmax)):
        if coef:
            d.scatter_add_(1, index[:, None], torch.full_like(index[:, None], -coef, dtype=d.dtype))
    return d


def _logits(x: torch.Tensor, weight: torch.Tensor, fp8) -> torch.Tensor:
    """x [c, H] @ weight.T -> [c, V] in the weight dtype; through the float8 head when there is one."""
    return x @ weight.T if fp8 is None else float8_mm(x.to(weight.dtype), fp8.for_logits)


def _hidden_grad(d_logits: torch.Tensor, weight: torch.Tensor, fp8) -> torch.Tensor:
    """d_logits [c, V] @ weight -> [c, H] in the weight dtype (float8: e5m2 gradient logits)."""
    d_logits = d_logits.to(weight.dtype)
    return d_logits @ weight if fp8 is None else float8_mm(d_logits, fp8.for_grad, gradient=True)


def fused_ce_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, want_grad: bool, fp8=None):
    """The cross-entropy of `softmax_rows` written for inductor: same results, fewer passes.

    `log_softmax` lowers to one online (max, sum-exp) reduction over the logits in the matmul's
    dtype; the label's log-probability is a gather, and softmax - onehot is one pointwise kernel
    that writes the gradient logits in the weight dtype. No float32 [c, V] tensor is written.
    The hand-written max/clamp/exp chain of `_log_softmax_clamped` defeats that fusion (two or
    three passes over float32 logits), and the clamp only matters on CPUs. `fp8`: the lm_head as a
    `fp8.Float8Head` (train.fp8_lm_head), which both matmuls then run through.
    """
    logits = _logits(hidden, weight, fp8)  # [c, V], weight dtype
    log_probs = logits.to(torch.promote_types(weight.dtype, torch.float32)).log_softmax(-1)  # fused away
    losses = -log_probs.gather(1, labels[:, None]).squeeze(1)
    argmax = logits.argmax(-1)
    if not want_grad:
        return losses, argmax, None
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    d_logits = log_probs.exp() - (vocab == labels[:, None]).to(log_probs.dtype)  # softmax - onehot
    return losses, argmax, _hidden_grad(d_logits, weight, fp8)  # [c, H]


def fused_mix_rows(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                   teacher: torch.Tensor, want_grad: bool, mix: LossMix, fp8=None):
    """`softmax_rows` with a teacher, written for inductor like `fused_ce_rows`: log_softmax
    expressions without the clamp chain, so the reductions and the gradient logits fuse. The mix's
    coefficients are Python constants (one graph per run); shapes are static, nothing syncs."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    logits = _logits(hidden, weight, fp8)  # [c, V], weight dtype
    t_logits = _logits(teacher.to(weight.dtype), weight, fp8)  # [c, V]
    log_probs = logits.to(acc).log_softmax(-1)
    argmax, t_argmax = logits.argmax(-1), t_logits.argmax(-1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    temp = mix.temperature
    losses = torch.zeros_like(argmax, dtype=acc)
    target = torch.zeros_like(log_probs) if want_grad else None  # c_ce onehot + c_ct onehot, [c, V]
    for coef, index in ((mix.ce, labels), (mix.ce_teacher, t_argmax)):
        if coef:
            losses = losses - coef * log_probs.gather(1, index[:, None]).squeeze(1)
            if want_grad:
                target = target + coef * (vocab == index[:, None]).to(acc)
    if mix.kl:
        t_log = (t_logits.to(acc) / temp).log_softmax(-1)
        s_log = log_probs if temp == 1 else (logits.to(acc) / temp).log_softmax(-1)
        losses = losses + (mix.kl * temp * temp) * (t_log.exp() * (t_log - s_log)).sum(-1)
    if not want_grad:
        return losses, argmax, None
    d_logits = (mix.ce + mix.ce_teacher) * log_probs.exp() - target
    if mix.kl:
        d_logits = d_logits + (mix.kl * temp) * (s_log.exp() - t_log.exp())
    return losses, argmax, _hidden_grad(d_logits, weight, fp8)  # [c, H]


def _rows_fused(hidden, weight, labels, teacher, want_grad, mix: LossMix, fp8=None):
    """Compiled entry point: the fused cross-entropy, or the fused mix when a teacher takes part."""
    if mix == CE:
        return fused_ce_rows(hidden, weight, labels, want_grad, fp8)
    if not mix.needs_teacher:  # a scaled data-token CE (mix with kl_weight=0)
        loss, top, grad = fused_ce_rows(hidden, weight, labels, want_grad, fp8)
        return mix.ce * loss, top, None if grad is None else mix.ce * grad
    return fused_mix_rows(hidden, weight, labels, teacher, want_grad, mix, fp8)


@functools.lru_cache(maxsize=None)
def compiled_softmax_rows():
    """The chunk function compiled once per process (static shapes: one graph per chunk shape)."""
    return torch.compile(_rows_fused, dynamic=False)


class _LinearSoftmaxLoss(torch.autograd.Function):
    """Per-row loss of logits = hidden @ weight.T: the `LossMix` of a data label, the teacher's
    argmax and the teacher's distribution (teacher logits = teacher @ weight.T, chunk by chunk).

    forward(hidden [T, H], weight [V, H], labels [T] | None, teacher [T, H] | None, chunk, compiled, mix, fp8)
      -> loss [T] (float32, or float64 for float64 inputs), argmax [T]
    fp8 (a `fp8.Float8Head` of weight, or None) runs the matmuls in float8, always in the fused form.
    The weight is frozen (no gradient); the gradient w.r.t. hidden is built chunk by chunk in
    the forward pass: d loss / d logits = softmax(logits) - target_distribution (`_d_logits`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, chunk: int, compiled: bool, mix: LossMix, fp8=None):
        hidden = hidden.to(weight.dtype)
        rows = hidden.shape[0]
        losses = hidden.new_empty(rows, dtype=torch.promote_types(weight.dtype, torch.float32))
        argmax = torch.empty(rows, dtype=torch.long, device=hidden.device)
        want_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if want_grad else None
        rows_fn = compiled_softmax_rows() if compiled else _rows_fused if fp8 is not None else softmax_rows
        extra = () if fp8 is None else (fp8,)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            part = slice(start, end)
            loss, top, d_hidden = rows_fn(hidden[part], weight, None if labels is None else labels[part],
                                          None if teacher is None else teacher[part], want_grad, mix, *extra)
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
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None, None, None, None


def linear_softmax_loss(hidden, weight, labels=None, teacher=None, chunk: int = 2048, compiled: bool = False,
                        mix: LossMix = CE, fp8=None):
    """Chunked lm_head + the per-row loss `mix` (module doc): labels [T] for its data-token CE,
    teacher [T, H] (the target's final hidden, already final-normed) for its teacher terms.

    compiled=True runs each chunk through `compiled_softmax_rows` (GPU training: fused passes); fp8, a
    `fp8.Float8Head` of weight, runs the lm_head's matmuls in float8 (train.fp8_lm_head)."""
    if mix.ce and labels is None:
        raise ValueError(f"{mix}: the data-token cross-entropy needs labels")
    if mix.needs_teacher and teacher is None:
        raise ValueError(f"{mix}: the teacher terms need the target's final hidden state (teacher)")
    return _LinearSoftmaxLoss.apply(hidden, weight, labels, teacher if mix.needs_teacher else None, chunk,
                                    compiled, mix, fp8)


def teacher_hidden_at(final_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The target's final hidden state for every block slot: [b, S, H], anchors [b, N] -> [b, N, B, H].

    Slot k of anchor a predicts token a + k, which the target predicts from position a + k - 1.
    Slot 0 (never predicted) and positions past the sequence (never valid) are clamped in range.
    """
    b, seq_len, hdim = final_hidden.shape
    offsets = torch.arange(block_size, device=anchors.device) - 1
    positions = (anchors[:, :, None] + offsets).clamp(0, seq_len - 1).view(b, -1)  # [b, N*B]
    picked = torch.gather(final_hidden, 1, positions[:, :, None].expand(-1, -1, hdim))  # [b, N*B, H]
    return picked.view(b, anchors.shape[1], block_size, hdim)


def slot_weights(block_size: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """w_k for slots 1..B-1: exp(-(k-1)/gamma), shape [B-1]."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float64)
    return torch.exp(-(k - 1) / gamma).to(dtype)


@dataclass
class LossStats:
    """Sums and counts of one batch; reduced across ranks by summing, divided only at the end.

    Per-slot tensors have B-1 entries, for slots 1..B-1.
    """

    loss_sum: torch.Tensor  # sum of w * loss over valid slots (the objective's numerator)
    weight_sum: torch.Tensor  # sum of w over valid slots (its denominator)
    slot_loss_sum: torch.Tensor  # [B-1] unweighted per-slot loss (the mix) summed per slot
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
               compiled: bool = False, mix: LossMix = CE, fp8=None) -> LossStats:
    """Loss sums for drafter outputs hidden [b, N*B, H] against data labels/valid [b, N, B].

    teacher_hidden [b, N, B, H] (`teacher_hidden_at`: the final-normed target hidden at a + k - 1)
    feeds the mix's teacher terms. Accuracy and simulated tau compare with the data labels always.
    """
    b, n, block = labels.shape
    h = hidden.view(b, n, block, -1)[:, :, 1:]  # [b, N, B-1, H]: slot 0 is never predicted
    lab = labels[:, :, 1:]
    ok = valid[:, :, 1:]
    teacher = None if teacher_hidden is None else teacher_hidden[:, :, 1:].reshape(-1, teacher_hidden.shape[-1])
    losses, argmax = linear_softmax_loss(h.reshape(-1, h.shape[-1]), lm_head_weight, lab.reshape(-1), teacher,
                                         chunk_tokens, compiled, mix, fp8)
    losses = losses.view(b, n, block - 1)
    okf = ok.to(losses.dtype)
    w = slot_weights(block, gamma, hidden.device, losses.dtype) * okf  # [b, N, B-1]
    correct = (argmax.view_as(lab) == lab) & ok  # against the data token: greedy acceptance
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
