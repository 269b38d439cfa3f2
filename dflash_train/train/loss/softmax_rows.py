"""The frozen lm_head and the per-row loss, chunk by chunk, inside one autograd Function.

For rows with hidden state h (already final-normed), the drafter's logits are
    z = T(h @ W.T + e @ M.T)
with W the target's frozen lm_head [V, H], T the target's output transform (`model.logits`), and an
optional trainable low-rank bias (e [rows, r] and M [V, r]: DSpark's Markov bias, `LowRankBias`).
The per-row loss is the `LossMix`
    l = c_ce * CE(z, label) + c_ct * CE(z, argmax t) + c_kl * T^2 * KL(softmax(t/T) || softmax(z/T))
        + c_tv * TV(softmax(t), softmax(z))
with t = T(teacher @ W.T) the target's own logits (`teacher`: its final hidden state).

The rows are weighted (`RowsSpec.weights`, `row_weights.py`: valid, the paper's decay or D-PACE, all
functions of this forward's outputs) and the differentiable output is the weighted sum
sum_t w_t l_t. Besides it, every row reports (no gradient): its loss l and weight w, the argmax,
log softmax(z)[label] (D-PACE's confidence), the TV distance (DSpark's confidence target) and
optionally the top-k of z (DFlash 2's candidates) with z[label].

Memory: `chunk` rows at a time (whole blocks); neither the drafter's nor the target's full [rows, V]
logits ever exist. Every gradient (hidden's, and a bias's inputs and weight) is built chunk by chunk
in the forward pass: d loss / d z is closed-form (`_d_logits`), times T'(z) where the transform is
not the identity, times the row's weight, then the matmuls (`_grads_of`); backward only scales them
by the scalar it receives. Compiled (`compiled_chunk`, GPU training), one graph runs from the
logits to those gradients, so no [c, V] tensor is written outside it: the logits and gradient
logits stay in the weight dtype, and with the fp8 lm_head the gradient logits' scaling and e5m2
cast fuse in too. Eagerly (the CPU path) about chunk * V * 6 bytes for CE (float32 logits reused in
place plus one copy in the weight dtype for the gradient matmul); a teacher adds its logits and
probabilities (2-3x).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dflash_train.fp8 import float8_mm
from dflash_train.model.target.logits import LogitTransform
from dflash_train.train.loss.row_weights import RowWeights, row_weights

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
    """The static part of a call (a compiled graph per distinct value): mix, transform, top-k, row weights."""

    mix: LossMix = CE
    transform: LogitTransform = LogitTransform()
    topk: int = 0
    weights: RowWeights = RowWeights()


class LowRankBias(NamedTuple):
    """A trainable logit bias e @ M.T: inputs e [rows, r] and weight M [V, r] (both may need grads)."""

    inputs: torch.Tensor
    weight: torch.Tensor


class RowsOut(NamedTuple):
    """Per-row results of `linear_softmax_loss` (only `loss_sum` carries a gradient)."""

    losses: torch.Tensor  # [T] float32 (float64 for float64 inputs), the mix's loss l per row
    argmax: torch.Tensor  # [T]
    label_logprob: torch.Tensor  # [T] log softmax(z)[label] (0 without labels)
    tv: torch.Tensor  # [T] TV(teacher, drafter) (0 without a tv term)
    topk_values: torch.Tensor | None  # [T, k] of z, when RowsSpec.topk
    topk_ids: torch.Tensor | None  # [T, k]
    label_logit: torch.Tensor  # [T] z[label]
    loss_sum: torch.Tensor  # [] sum_t w_t l_t: the one output with a gradient
    weights: torch.Tensor  # [T] w_t (`RowsSpec.weights`: 0 for invalid rows)


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


def _grads_of(d_raw: torch.Tensor, weight: torch.Tensor, fp8, bias: LowRankBias | None):
    """Weighted gradient logits d_raw [c, V] -> (d hidden [c, H], d bias inputs [c, r], d bias weight
    [V, r] in >= float32), the matmuls in the weight dtype (float8 with an fp8 head: e5m2 gradient
    logits, one scale per chunk)."""
    d_raw = d_raw.to(weight.dtype)
    d_hidden = d_raw @ weight if fp8 is None else float8_mm(d_raw, fp8.for_grad, gradient=True)
    if bias is None:
        return d_hidden, None, None
    d_in = d_raw @ bias.weight.to(weight.dtype)  # [c, r]
    d_w = (d_raw.T @ bias.inputs.to(weight.dtype)).to(torch.promote_types(bias.weight.dtype, torch.float32))
    return d_hidden, d_in, d_w


def _chunk(rows_fn, hidden, weight, labels, teacher, bias, valid, want_grad: bool, spec: RowsSpec, fp8=None):
    """One chunk of whole blocks: (RowsOut fields of its rows, (d hidden, d bias inputs, d bias weight)
    of its weighted loss sum or None). The row weights (`row_weights`) scale each row's gradient
    logits before the matmuls, so every gradient is final up to the caller's scalar."""
    out, d_raw = rows_fn(hidden, weight, labels, teacher, bias, want_grad, spec, fp8)
    losses, label_logprob = out[0], out[2]
    w = row_weights(spec.weights, label_logprob, valid).to(losses.dtype)  # [c], no gradient
    out = (*out, (w * losses).sum(), w)
    if not want_grad:
        return out, None
    return out, _grads_of(d_raw.mul_(w[:, None].to(d_raw.dtype)), weight, fp8, bias)


def eager_chunk(*args):
    """`_chunk` of `softmax_rows` (the CPU's eager path)."""
    return _chunk(softmax_rows, *args)


def fused_chunk(*args):
    """`_chunk` of `fused_rows`: compiled (`compiled_chunk`) everything from the logits to the
    gradients is one graph, so no [c, V] tensor leaves it (test_softmax_rows.py checks the profile)."""
    return _chunk(fused_rows, *args)


@functools.lru_cache(maxsize=None)
def compiled_chunk():
    """The chunk function compiled once per process (static shapes: one graph per chunk shape)."""
    return torch.compile(fused_chunk, dynamic=False)


def _chunk_fn(compiled: bool, fp8):
    return compiled_chunk() if compiled else fused_chunk if fp8 is not None else eager_chunk


def _chunks(rows: int, chunk: int, block: int):
    """Slices of `chunk` rows rounded down to whole blocks of `block` rows (at least one block)."""
    step = max(block, chunk - chunk % block)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _part(t: torch.Tensor | None, part: slice):
    return None if t is None else t[part]


class _LinearSoftmaxLoss(torch.autograd.Function):
    """forward(hidden [T, H], weight [V, H] (frozen), labels [T] | None, teacher [T, H] | None,
    bias_inputs [T, r] | None, bias_weight [V, r] | None, valid [T] | None, chunk, compiled, spec, fp8)
    -> RowsOut fields; only `loss_sum` (sum_t w_t l_t) carries a gradient.

    Every gradient (hidden's, and the bias's inputs and weight, DSpark's Markov bias) is built chunk
    by chunk in the forward pass, each row's weighted in; backward scales them by the one scalar
    it receives."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, bias_in, bias_w, valid, chunk: int, compiled: bool,
                spec: RowsSpec, fp8=None):
        hidden = hidden.to(weight.dtype)
        needs = ctx.needs_input_grad
        want_grad = needs[0] or needs[4] or needs[5]
        fn, parts = _chunk_fn(compiled, fp8), []
        grads = _GradSums(hidden, bias_in, bias_w) if want_grad else None
        for part in _chunks(hidden.shape[0], chunk, spec.weights.block):
            bias = None if bias_in is None else LowRankBias(bias_in[part], bias_w)
            out, chunk_grads = fn(hidden[part], weight, _part(labels, part), _part(teacher, part), bias,
                                  _part(valid, part), want_grad, spec, fp8)
            parts.append(out)
            if want_grad:
                grads.add(part, *chunk_grads)
        outs = [_joined(column) for column in zip(*parts)]
        ctx.mark_non_differentiable(*[t for i, t in enumerate(outs) if t is not None and i != LOSS_SUM])
        ctx.bias_dtype = None if bias_w is None else bias_w.dtype
        ctx.set_materialize_grads(False)  # the other outputs have no gradient: no zeros for them in backward
        ctx.save_for_backward(*((grads.hidden, grads.bias_in, grads.bias_w) if want_grad else ()))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        scale, needs = grad_outs[LOSS_SUM], ctx.needs_input_grad
        d_hidden, d_in, d_w = [None if g is None else g * scale.to(g.dtype) for g in ctx.saved_tensors] \
            if ctx.saved_tensors and scale is not None else (None, None, None)
        d_w = None if d_w is None else d_w.to(ctx.bias_dtype)
        return (d_hidden if needs[0] else None, None, None, None, d_in if needs[4] else None,
                d_w if needs[5] else None, None, None, None, None, None)


LOSS_SUM = RowsOut._fields.index("loss_sum")


def _joined(column):
    if column[0] is None:
        return None
    return torch.stack(column).sum() if column[0].dim() == 0 else torch.cat(list(column))


class _GradSums:
    """The forward's gradients: hidden's and the bias inputs' row by row, the bias weight's summed."""

    def __init__(self, hidden, bias_in, bias_w):
        self.hidden = torch.empty_like(hidden)
        self.bias_in = None if bias_in is None else torch.empty_like(bias_in)
        acc = None if bias_w is None else torch.promote_types(bias_w.dtype, torch.float32)
        self.bias_w = None if bias_w is None else torch.zeros(bias_w.shape, dtype=acc, device=bias_w.device)

    def add(self, part: slice, d_hidden, d_in, d_w) -> None:
        self.hidden[part] = d_hidden
        if d_in is not None:
            self.bias_in[part] = d_in.to(self.bias_in.dtype)
            self.bias_w += d_w


def linear_softmax_loss(hidden, weight, labels=None, teacher=None, chunk: int = 2048, compiled: bool = False,
                        spec: RowsSpec = RowsSpec(), fp8=None, bias: LowRankBias | None = None,
                        valid: torch.Tensor | None = None) -> RowsOut:
    """Chunked lm_head + the per-row loss of `spec.mix` (module doc), weighted by `spec.weights`
    (with `valid` [T], None: all rows): labels [T] for the data-token CE (and the confidences),
    teacher [T, H] (the target's final hidden, final-normed) for the teacher terms, `bias` for a
    trainable low-rank logit bias. `loss_sum` is the one output with a gradient.

    compiled=True runs each chunk through `compiled_chunk` (GPU training: one fused graph from the
    logits to the gradients); fp8, a `fp8.Float8Head` of weight, runs the lm_head's matmuls in float8
    (train.fp8_lm_head)."""
    mix = spec.mix
    if mix.ce and labels is None:
        raise ValueError(f"{mix}: the data-token cross-entropy needs labels")
    if mix.needs_teacher and teacher is None:
        raise ValueError(f"{mix}: the teacher terms need the target's final hidden state (teacher)")
    if spec.weights.kind == "dpace" and labels is None:
        raise ValueError("D-PACE weights need labels (the drafter's confidence in the data token)")
    bias_in, bias_w = bias if bias is not None else (None, None)
    out = _LinearSoftmaxLoss.apply(hidden, weight, labels, teacher if mix.needs_teacher else None, bias_in, bias_w,
                                   valid, chunk, compiled, spec, fp8)
    return RowsOut(*out)
