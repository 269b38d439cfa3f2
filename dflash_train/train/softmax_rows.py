"""The frozen lm_head and the per-row loss, chunk by chunk, inside one autograd Function.

For rows with hidden state h (already final-normed), the drafter's logits are
    z = T(h @ W.T + e @ M.T)
with W the target's frozen lm_head [V, H], T the target's output transform (`model.logits`), and an
optional trainable low-rank bias (e [rows, r] and M [V, r]: DSpark's Markov bias, `LowRankBias`).
The per-row loss is the `LossMix`
    l = c_ce * CE(z, label) + c_ct * CE(z, argmax t) + c_kl * T^2 * KL(softmax(t/T) || softmax(z/T))
        + c_tv * TV(softmax(t), softmax(z))
with t = T(teacher @ W.T) the target's own logits (`teacher`: its final hidden state).

Besides the loss, every row reports (no gradient): the argmax, log softmax(z)[label] (D-PACE's
confidence), the TV distance (DSpark's confidence target) and optionally the top-k of z (DFlash 2's
candidates) with z[label].

Memory: `chunk` rows at a time; neither the drafter's nor the target's full [rows, V] logits ever
exist. The gradient with respect to h (and e, M) is built chunk by chunk in the forward pass:
d loss / d z is closed-form (`_d_logits`), times T'(z) where the transform is not the identity.
Peak extra memory for CE is about chunk * V * 6 bytes eagerly (fp32 logits reused in place plus one
copy in the weight dtype for the gradient matmul); compiled, the logits and gradient logits stay in
the weight dtype. A teacher adds its logits and probabilities (2-3x eagerly).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_train.fp8 import float8_mm
from dflash_train.model.logits import LogitTransform

UNDERFLOW_CLAMP = -80.0  # exp() below e^-87 yields float32 subnormals: ~60x slower on CPU


@dataclass(frozen=True)
class LossMix:
    """Coefficients of the per-row loss (module doc): data-token CE, teacher-argmax CE, KL at T, TV."""

    ce: float = 1.0
    ce_teacher: float = 0.0
    kl: float = 0.0
    temperature: float = 1.0
    tv: float = 0.0

    @property
    def needs_teacher(self) -> bool:
        return self.ce_teacher != 0 or self.kl != 0 or self.tv != 0

    @classmethod
    def from_config(cls, loss_cfg) -> "LossMix":
        """The mix of config.LossConfig (kind, temperature, kl_weight, tv_weight)."""
        temperature = float(loss_cfg.temperature)
        return {"ce": cls(),
                "ce_teacher": cls(ce=0.0, ce_teacher=1.0),
                "kl": cls(ce=0.0, kl=1.0, temperature=temperature),
                "mix": cls(ce=1.0 - loss_cfg.kl_weight, kl=float(loss_cfg.kl_weight), temperature=temperature),
                "tv": cls(ce=1.0 - loss_cfg.tv_weight, tv=float(loss_cfg.tv_weight)),
                }[loss_cfg.kind]


CE = LossMix()


@dataclass(frozen=True)
class RowsSpec:
    """The static part of a call (a compiled graph per distinct value): mix, transform, top-k."""

    mix: LossMix = CE
    transform: LogitTransform = LogitTransform()
    topk: int = 0


class LowRankBias(NamedTuple):
    """A trainable logit bias e @ M.T: inputs e [rows, r] and weight M [V, r] (both may need grads)."""

    inputs: torch.Tensor
    weight: torch.Tensor


class RowsOut(NamedTuple):
    """Per-row results of `linear_softmax_loss` (only `losses` carries a gradient)."""

    losses: torch.Tensor  # [T] float32 (float64 for float64 inputs)
    argmax: torch.Tensor  # [T]
    label_logprob: torch.Tensor  # [T] log softmax(z)[label] (0 without labels)
    tv: torch.Tensor  # [T] TV(teacher, drafter) (0 without a tv term)
    topk_values: torch.Tensor | None  # [T, k] of z, when RowsSpec.topk
    topk_ids: torch.Tensor | None  # [T, k]
    label_logit: torch.Tensor  # [T] z[label]


def _log_softmax_clamped(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of float32+ logits [c, V], the shifted logits clamped below at -80, in place.

    The clamp changes nothing a float32 softmax can represent (e^-80 < 2e-35 of the largest
    term) but keeps exp() off the subnormal slow path. A label 80 nats below the best token
    saturates the loss at ~80 + log V with the correct gradient direction (softmax - onehot).
    """
    shifted = logits.sub_(logits.amax(-1, keepdim=True)).clamp_(min=UNDERFLOW_CLAMP)  # [c, V]
    return shifted.sub_(shifted.exp().sum(-1, keepdim=True).log())


def _picked(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return values.gather(1, index[:, None]).squeeze(1)  # [c]


def _raw_logits(x: torch.Tensor, weight: torch.Tensor, fp8, bias: LowRankBias | None) -> torch.Tensor:
    """x [c, H] @ weight.T (+ e @ M.T) -> [c, V] in the weight dtype; float8 with an fp8 head."""
    raw = x @ weight.T if fp8 is None else float8_mm(x.to(weight.dtype), fp8.for_logits)
    if bias is not None:
        raw = raw + bias.inputs.to(weight.dtype) @ bias.weight.to(weight.dtype).T
    return raw


def _tv_and_grad(q: torch.Tensor, p: torch.Tensor, want_grad: bool):
    """TV(p, q) = 1/2 sum |q - p| per row, and its gradient with respect to the logits of q:
    1/2 q * (s - sum(q * s)), s = sign(q - p)."""
    diff = q - p
    tv = 0.5 * diff.abs().sum(-1)
    if not want_grad:
        return tv, None
    s = diff.sign()
    return tv, 0.5 * q * (s - (q * s).sum(-1, keepdim=True))


def _d_logits(log_probs, s_log_t, t_prob, labels, t_argmax, mix: LossMix) -> torch.Tensor:
    """d loss / d z [c, V] of the CE and KL terms, in place over `log_probs`:
    (c_ce + c_ct) softmax(z) - c_ce onehot(label) - c_ct onehot(argmax t) + c_kl T (softmax(z/T) - softmax(t/T))."""
    hard = mix.ce + mix.ce_teacher
    d = log_probs.exp_()  # softmax(z)
    if mix.kl and s_log_t is None:  # T = 1: softmax(z/T) is softmax(z)
        d.mul_(hard + mix.kl).sub_(t_prob, alpha=mix.kl)
    else:
        d.mul_(hard)
        if mix.kl:
            d.add_(s_log_t.exp_().sub_(t_prob), alpha=mix.kl * mix.temperature)
    for coef, index in ((mix.ce, labels), (mix.ce_teacher, t_argmax)):
        if coef:
            d.scatter_add_(1, index[:, None], torch.full_like(index[:, None], -coef, dtype=d.dtype))
    return d


def _summaries(z: torch.Tensor, labels, spec: RowsSpec):
    """argmax, top-k and z[label] of transformed logits [c, V] (before they are overwritten)."""
    top = z.topk(spec.topk, dim=-1) if spec.topk else (None, None)
    label_logit = _picked(z, labels) if labels is not None else z.new_zeros(z.shape[0])
    return z.argmax(-1), top[0], top[1], label_logit


def softmax_rows(hidden, weight, labels, teacher, bias, want_grad: bool, spec: RowsSpec, fp8=None):
    """One chunk of rows, eager (CPU-safe): (RowsOut fields, d loss / d raw logits [c, V] or None).

    Each pass reads and writes the whole chunk of float32 logits in place; the clamp in
    `_log_softmax_clamped` keeps exp() off the CPU's subnormal slow path. `fused_rows` is the
    compiled (GPU) twin."""
    mix, acc = spec.mix, torch.promote_types(weight.dtype, torch.float32)  # softmax in >= float32
    z = spec.transform(_raw_logits(hidden, weight, fp8, bias).to(acc))  # [c, V]
    dz = spec.transform.derivative(z) if want_grad else None
    argmax, top_v, top_i, label_logit = _summaries(z, labels, spec)
    temp = mix.temperature
    s_log_t = _log_softmax_clamped(z / temp) if mix.kl and temp != 1 else None  # drafter at T
    log_probs = _log_softmax_clamped(z)  # [c, V], in place: `z` is gone
    label_logprob = _picked(log_probs, labels) if labels is not None else log_probs.new_zeros(argmax.shape)
    losses = -mix.ce * label_logprob if mix.ce else torch.zeros_like(label_logprob)
    t_argmax = t_prob = tv = d_tv = None
    if mix.needs_teacher:
        t_logits = spec.transform(_raw_logits(teacher.to(weight.dtype), weight, fp8, None).to(acc))  # [c, V]
        t_argmax = t_logits.argmax(-1)
        if mix.ce_teacher:
            losses = losses - mix.ce_teacher * _picked(log_probs, t_argmax)
        if mix.tv:
            tv, d_tv = _tv_and_grad(log_probs.exp(), t_logits.softmax(-1), want_grad)
            losses = losses + mix.tv * tv
        if mix.kl:
            t_log = _log_softmax_clamped(t_logits / temp if temp != 1 else t_logits)  # [c, V]
            t_prob = t_log.exp()
            s_log = log_probs if s_log_t is None else s_log_t
            losses = losses + (mix.kl * temp * temp) * (t_prob * t_log.sub_(s_log)).sum(-1)
    tv = tv if tv is not None else torch.zeros_like(losses)
    out = (losses, argmax, label_logprob, tv, top_v, top_i, label_logit)
    if not want_grad:
        return out, None
    d = _d_logits(log_probs, s_log_t, t_prob, labels, t_argmax, mix)
    if d_tv is not None:
        d.add_(d_tv, alpha=mix.tv)
    return out, d if dz is None else d.mul_(dz)


def fused_rows(hidden, weight, labels, teacher, bias, want_grad: bool, spec: RowsSpec, fp8=None):
    """`softmax_rows` written for inductor: log_softmax expressions without the clamp chain, so the
    reductions and the gradient logits fuse; no float32 [c, V] tensor is written for plain CE. The
    spec's coefficients are Python constants (one graph per run); shapes are static, nothing syncs."""
    mix, acc = spec.mix, torch.promote_types(weight.dtype, torch.float32)
    raw = _raw_logits(hidden, weight, fp8, bias)  # [c, V], weight dtype
    z = raw if spec.transform.identity else spec.transform(raw.to(acc))
    argmax, top_v, top_i, label_logit = _summaries(z, labels, spec)
    log_probs = z.to(acc).log_softmax(-1)  # fused away
    vocab = torch.arange(z.shape[-1], device=z.device)
    temp = mix.temperature
    label_logprob = _picked(log_probs, labels) if labels is not None else log_probs.new_zeros(argmax.shape)
    losses = -mix.ce * label_logprob
    tv = torch.zeros_like(losses)
    d = (mix.ce + mix.ce_teacher) * log_probs.exp() if want_grad else None  # [c, V]
    if mix.ce and want_grad:
        d = d - mix.ce * (vocab == labels[:, None]).to(acc)
    if mix.needs_teacher:
        t_raw = _raw_logits(teacher.to(weight.dtype), weight, fp8, None)
        t_z = t_raw if spec.transform.identity else spec.transform(t_raw.to(acc))
        if mix.ce_teacher:
            t_argmax = t_z.argmax(-1)
            losses = losses - mix.ce_teacher * _picked(log_probs, t_argmax)
            d = d - mix.ce_teacher * (vocab == t_argmax[:, None]).to(acc) if want_grad else d
        if mix.kl:
            t_log = (t_z.to(acc) / temp).log_softmax(-1)
            s_log = log_probs if temp == 1 else (z.to(acc) / temp).log_softmax(-1)
            losses = losses + (mix.kl * temp * temp) * (t_log.exp() * (t_log - s_log)).sum(-1)
            d = d + (mix.kl * temp) * (s_log.exp() - t_log.exp()) if want_grad else d
        if mix.tv:
            tv, d_tv = _tv_and_grad(log_probs.exp(), t_z.to(acc).softmax(-1), want_grad)
            losses = losses + mix.tv * tv
            d = d + mix.tv * d_tv if want_grad else d
    out = (losses, argmax, label_logprob, tv, top_v, top_i, label_logit)
    if not want_grad:
        return out, None
    return out, d if spec.transform.identity else d * spec.transform.derivative(z.to(acc))


@functools.lru_cache(maxsize=None)
def compiled_rows():
    """The chunk function compiled once per process (static shapes: one graph per chunk shape)."""
    return torch.compile(fused_rows, dynamic=False)


def _grads_of(d_raw: torch.Tensor, weight: torch.Tensor, fp8) -> torch.Tensor:
    """d_raw [c, V] -> d hidden [c, H] in the weight dtype (float8: e5m2 gradient logits)."""
    d_raw = d_raw.to(weight.dtype)
    return d_raw @ weight if fp8 is None else float8_mm(d_raw, fp8.for_grad, gradient=True)


def _rows_fn(compiled: bool, fp8):
    return compiled_rows() if compiled else fused_rows if fp8 is not None else softmax_rows


class _LinearSoftmaxLoss(torch.autograd.Function):
    """forward(hidden [T, H], weight [V, H] (frozen), labels [T] | None, teacher [T, H] | None,
    bias_inputs [T, r] | None, bias_weight [V, r] | None, chunk, compiled, spec, fp8) -> RowsOut fields.

    Without a bias the gradient of hidden is built chunk by chunk in the forward pass and scaled
    per row in backward. A bias weight's gradient sums over rows, which needs the per-row scales
    first: then backward recomputes each chunk's logits (one more lm_head pass, DSpark only)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, bias_in, bias_w, chunk: int, compiled: bool,
                spec: RowsSpec, fp8=None):
        hidden = hidden.to(weight.dtype)
        ctx.setup = (chunk, compiled, spec, fp8)
        recompute = bias_in is not None
        want_grad = ctx.needs_input_grad[0] and not recompute
        grad = torch.empty_like(hidden) if want_grad else None
        rows_fn, parts = _rows_fn(compiled, fp8), []
        for part in _chunks(hidden.shape[0], chunk):
            out, d_raw = rows_fn(hidden[part], weight, _part(labels, part), _part(teacher, part),
                                 _bias_part(bias_in, bias_w, part), want_grad, spec, fp8)
            parts.append(out)
            if want_grad:
                grad[part] = _grads_of(d_raw, weight, fp8)
        outs = [torch.cat(list(column)) if column[0] is not None else None for column in zip(*parts)]
        ctx.mark_non_differentiable(*[t for t in outs[1:] if t is not None])
        ctx.save_for_backward(*((hidden, weight, labels, teacher, bias_in, bias_w) if recompute else (grad,)))
        return tuple(outs)

    @staticmethod
    def backward(ctx, grad_losses, *unused):
        if len(ctx.saved_tensors) == 1:
            (grad,) = ctx.saved_tensors
            d_hidden = None if grad is None else grad * grad_losses[:, None].to(grad.dtype)
            return d_hidden, None, None, None, None, None, None, None, None, None
        return (*_recomputed_grads(ctx, grad_losses), None, None, None, None)


def _chunks(rows: int, chunk: int):
    return [slice(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


def _part(t: torch.Tensor | None, part: slice):
    return None if t is None else t[part]


def _bias_part(bias_in, bias_w, part: slice) -> LowRankBias | None:
    return None if bias_in is None else LowRankBias(bias_in[part], bias_w)


def _recomputed_grads(ctx, grad_losses):
    """Gradients of hidden, bias inputs and bias weight, recomputing each chunk's logits (with a bias)."""
    hidden, weight, labels, teacher, bias_in, bias_w = ctx.saved_tensors
    chunk, compiled, spec, fp8 = ctx.setup
    rows_fn = _rows_fn(compiled, fp8)
    d_hidden, d_in = torch.empty_like(hidden), torch.empty_like(bias_in)
    acc = torch.promote_types(bias_w.dtype, torch.float32)
    d_w = torch.zeros(bias_w.shape, dtype=acc, device=bias_w.device)
    for part in _chunks(hidden.shape[0], chunk):
        _, d_raw = rows_fn(hidden[part], weight, _part(labels, part), _part(teacher, part),
                           _bias_part(bias_in, bias_w, part), True, spec, fp8)
        d_raw = d_raw * grad_losses[part, None].to(d_raw.dtype)  # [c, V]: each row's loss weight
        d_hidden[part] = _grads_of(d_raw, weight, fp8)
        d_in[part] = (d_raw.to(bias_w.dtype) @ bias_w).to(d_in.dtype)
        d_w += d_raw.T.to(acc) @ bias_in[part].to(acc)
    needs = ctx.needs_input_grad
    return (d_hidden if needs[0] else None, None, None, None, d_in if needs[4] else None,
            d_w.to(bias_w.dtype) if needs[5] else None)


def linear_softmax_loss(hidden, weight, labels=None, teacher=None, chunk: int = 2048, compiled: bool = False,
                        spec: RowsSpec = RowsSpec(), fp8=None, bias: LowRankBias | None = None) -> RowsOut:
    """Chunked lm_head + the per-row loss of `spec.mix` (module doc): labels [T] for the data-token
    CE (and the confidences), teacher [T, H] (the target's final hidden, final-normed) for the
    teacher terms, `bias` for a trainable low-rank logit bias (its backward recomputes the logits).

    compiled=True runs each chunk through `compiled_rows` (GPU training: fused passes); fp8, a
    `fp8.Float8Head` of weight, runs the lm_head's matmuls in float8 (train.fp8_lm_head)."""
    mix = spec.mix
    if mix.ce and labels is None:
        raise ValueError(f"{mix}: the data-token cross-entropy needs labels")
    if mix.needs_teacher and teacher is None:
        raise ValueError(f"{mix}: the teacher terms need the target's final hidden state (teacher)")
    bias_in, bias_w = bias if bias is not None else (None, None)
    out = _LinearSoftmaxLoss.apply(hidden, weight, labels, teacher if mix.needs_teacher else None, bias_in, bias_w,
                                   chunk, compiled, spec, fp8)
    return RowsOut(*out)
