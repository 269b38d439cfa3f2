"""Muon for the drafter's hidden matrices, AdamW for the rest (`optim.name=muon`).

The split (`muon_split`, speculators' rule, `../shared/docs/dflash2-and-2026-recipe.md` section 4):
Muon takes every trainable 2-D parameter with min(dim) > 1 whose name contains none of
`MUON_EXCLUDED` nor a word a drafter head keeps out (`Head.outside_muon`: DFlash 2's codebooks,
DSpark's Markov head; the decoder's projections, `fc`, DFlash 2's `kernel_projection` and
`hidden_projection` go to Muon); AdamW takes norms, biases, other shapes (a 3-D `base_kernel`), the
heads' tables and anything named after the target's embedding or lm_head.

The update is torch.optim.Muon's (momentum 0.95 Nesterov, Newton-Schulz with torch's coefficients:
in bf16 with `optim.muon_iteration=newton_schulz`, the default `gram` runs the same polynomial in
another form, below; `adjust_lr_fn="match_rms_adamw"`: each matrix's step scaled by
0.2 * sqrt(max(A, B)), the RMS of an AdamW update, so one lr and one schedule serve both parts;
decoupled weight decay lr * muon_weight_decay), with its state_dict layout (a checkpoint of torch's
Muon resumes here and back), computed as a training step wants it (`Muon`):
- matrices of one shape are orthogonalised together (a tall one as its transpose, as torch's
  iteration runs it): one batched matmul (bmm) per Newton-Schulz product instead of one matmul per
  matrix (a 5-layer drafter: 4 batches of 5-15 matrices, where torch ran 36 matrices one by one);
- no float32 copy of a bf16 gradient: the division by `grad_scale` and the momentum read it as it is;
- no host sync: a skipped step (`found_inf` = 1) is decided on the device, every buffer and weight
  written back as it was (torch's Muon has no found_inf input: the step used to read it on the host);
- on CUDA the elementwise work (momentum, Nesterov, the cast and stacking, decay and update, the bf16
  copy of the master) runs as compiled kernels;
- with several drafter ranks each rank orthogonalises only its share of every shape's matrices and
  all-gathers the bf16 results (Keller Jordan's reference and Moonlight's distributed Muon); the
  momentum is advanced on every rank from the reduced gradient (elementwise, cheap), so each rank
  holds the whole state and a checkpoint needs no gather.
`optim.muon_coefficients=polar_express` orthogonalises with Polar Express's per-iteration quintics (Amsel et
al. 2025, arXiv 2505.16932), a schedule made for `muon_ns_steps` iterations (train/optim/polar_express.py: at 5
iterations modded-nanogpt's published one, normalised with its 2 % margin). Measured here
(tests/train/optim/test_muon_step.py, docs/PERF.md): at 5 iterations its singular values end in [0.86, 1.14] where
torch's quintic leaves [0.68, 1.20]; the published schedule's first 4 alone leave [0.42, 1.57], a schedule made
for 4 from singular values down to 3e-3 (`muon_polar_lower`) [0.78, 1.21] for every one >= 3e-3. The
coefficients are independent of the form below: each form runs whichever schedule it is given.
`optim.muon_iteration=gram` (the default) runs the quintics in their Gram form (`gram_orthogonalise`)
on every batch where that form takes fewer FLOPs (`uses_gram`: the wide ones, long side > 1.5x the
short; at the paper shapes gate/up/down, k/v and fc; q and o are square and keep the standard form):
the same polynomial, 101.3 -> 79.5 TFLOP per step at the paper shapes. Its float16 arithmetic is
closer to the float64 polynomial than the standard form's bf16, and the CPU golden run's losses follow
the standard form's within 0.003 over 64 steps (docs/PERF.md 3.7): that is why it is the default;
`newton_schulz` is torch.optim.Muon's update bit for bit, the tests' reference.
`optim.muon_iteration=gram_symmetric` is `gram` with every product whose result is symmetric (all but the
final X <- Q X: the [m, m] iterates are polynomials in one Gram matrix, which commute) computed on its
upper block triangle of `optim.muon_gram_blocks` = k blocks and mirrored (train/optim/symmetric.py):
(k + 1) / 2k of those products' FLOPs, which makes the Gram form cheaper than the standard one on the
square q and o too, 79.5 -> 58.5 TFLOP per step at the paper shapes with k = 4 (54.3 with 8). Equal to
`gram` with full products in float64 (tests/train/optim/test_muon_symmetric.py); its GPU speed is not
measured yet, so `gram` stays the default.
On CUDA the module's parameters are bf16 (what the matmuls read) and Muon runs on float32 masters,
as `optim.MasterWeightAdamW` does for the AdamW part: the bf16 weight is the master rounded.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.distributed as dist

from dflash_train.model.drafter.heads.architectures import outside_muon
from dflash_train.train.optim.polar_express import PUBLISHED_LOWER, polar_express_schedule
from dflash_train.train.optim.symmetric import padded, symmetric_baddbmm, symmetric_flops

MUON_EXCLUDED = ("embed_tokens", "lm_head")  # the target's tables, should they ever be trained
TORCH_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
POLAR_EXPRESS_SAFETY = 1.02  # Polar Express normalises to spectral norm <= 1 / 1.02: a margin for bf16 rounding
ITERATIONS = ("newton_schulz", "gram", "gram_symmetric")
COEFFICIENTS = ("torch", "polar_express")
EPS = 1e-7  # torch.optim.Muon's


def muon_split(named_params) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """(Muon's, AdamW's) trainable (name, parameter) pairs, in module order (rule: module doc)."""
    excluded = MUON_EXCLUDED + outside_muon()  # what each registered head keeps out of Muon
    muon, adamw = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(word in name for word in excluded)
        (muon if hidden_matrix else adamw).append((name, p))
    return muon, adamw


def describe_split(muon: list, adamw: list) -> str:
    """One line per part: tensors, parameters, float32 bytes and the names (layer indices folded)."""
    def part(label: str, named: list) -> str:
        numel = sum(p.numel() for _, p in named)
        names = list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name, _ in named))
        size = f"{numel * 4 / 2**20:.1f} MiB" if numel * 4 >= 2**20 else f"{numel * 4 / 2**10:.1f} KiB"
        return (f"optim: {label} {len(named)} tensors, {numel:,} parameters ({size} in float32): "
                f"{', '.join(names) or '-'}")
    return part("Muon ", muon) + "\n" + part("AdamW", adamw)


def ns_schedule(coefficients: str, ns_steps: int, lower: float = PUBLISHED_LOWER
                ) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """(quintic per iteration, norm safety factor) of `optim.muon_coefficients` at `muon_ns_steps` iterations
    (`lower`: `optim.muon_polar_lower`, read by polar_express only)."""
    if coefficients == "torch":
        return (TORCH_COEFFICIENTS,) * ns_steps, 1.0
    if coefficients == "polar_express":
        return polar_express_schedule(ns_steps, lower), POLAR_EXPRESS_SAFETY
    raise ValueError(f"optim.muon_coefficients={coefficients!r}: expected one of {', '.join(COEFFICIENTS)}")


def orthogonalise(updates: torch.Tensor, coefficients, safety: float = 1.0, eps: float = EPS,
                  gram: bool = False, blocks: int = 1) -> torch.Tensor:
    """The Newton-Schulz iteration of torch.optim.Muon over a batch: updates [n, A, B] -> bf16 [n, A, B].
    Each matrix is scaled to Frobenius norm <= 1 (spectral norm <= 1), then X <- a X + (b G + c G^2) X
    with G = X X^T on the short side, one batched matmul per product. `gram`: the Gram form instead
    where it takes fewer FLOPs (`uses_gram`), in float16 on CUDA (float32 elsewhere: a CPU's float16
    matmul runs ~60x slower than its bf16, measured on the team's box); `blocks` > 1: its symmetric
    products on the upper block triangle (`gram_orthogonalise`), and the choice made at that cost."""
    x = updates.bfloat16()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    if gram and uses_gram(*x.shape[-2:], len(coefficients), blocks):
        dtype = torch.float16 if x.is_cuda else torch.float32
        x = gram_orthogonalise(x, coefficients, safety, eps, dtype, blocks).bfloat16()
        return x.mT if tall else x
    norm = x.norm(dim=(-2, -1), keepdim=True)  # [n, 1, 1]
    x = x / (norm if safety == 1.0 else norm * safety).clamp(min=eps)
    for a, b, c in coefficients:
        gram_matrix = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def gram_restarts(steps: int) -> range:
    """The iterations before which the Gram form restarts (X <- Q X, R <- X X^T, Q <- I): after every
    2 iterations, the last run up to 3 long (5 steps: after the 2nd, the published schedule)."""
    return range(2, steps - 1, 2)


def gram_orthogonalise(x: torch.Tensor, coefficients, safety: float = 1.0, eps: float = EPS,
                       dtype: torch.dtype = torch.float16, blocks: int = 1) -> torch.Tensor:
    """The iteration of `orthogonalise` on the Gram matrix: x [n, m, k] (m <= k) -> [n, m, k] in `dtype`.
    With R = X X^T and Z = b R + c R^2, one step X <- (a I + Z) X is R <- (a I + Z) R (a I + Z) and
    Q <- (a I + Z) Q (polynomials in R commute), all [m, m]; X is read at the start, at each restart
    and at the end (X <- Q X). After Zhang, Amsel, Chen and Dao, "Gram Newton-Schulz" (Dao AI Lab
    blog and github.com/Dao-AILab/gram-newton-schulz, 2026; DeepSpeed's Muon runs torch's coefficients
    so): normalised in float32, then float16 (3 more mantissa bits than bf16 at the same speed on a
    GPU; measured here, the Gram form in bf16 lands farther from the float64 polynomial than the
    standard form in bf16); restarted (`gram_restarts`) because R, carried by products only, drifts
    from X X^T: a rounding that makes an eigenvalue r of R slightly negative is multiplied by
    (a + b r + c r^2)^2 >= a^2 ~ 12 per iteration (b < 0) until R is recomputed from X (without the
    restart, singular values of 2-2.4 on a 3-decade spectrum: tests/train/optim/test_muon_step.py).
    `blocks` > 1 (`gram_symmetric`): every product but X <- Q X has a symmetric result and is computed on
    its upper block triangle (train/optim/symmetric.py), m padded with zero rows to a multiple of
    `blocks` (they stay zero: R's padded rows and columns are 0, Q's a power of a on the diagonal)."""
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True,  # [n, 1, 1], float64 for a float64 test
                                     dtype=torch.promote_types(x.dtype, torch.float32))
    x = torch.div(x, (norm * safety).clamp(min=eps), out=torch.empty(x.shape, dtype=dtype, device=x.device))
    m = x.shape[-2]
    if padded(m, blocks) > m:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded(m, blocks) - m))

    def sym(base, left, right, beta=1.0, alpha=1.0):  # beta base + alpha left right, a symmetric result
        return symmetric_baddbmm(base, left, right, beta, alpha, blocks)

    restarts = gram_restarts(len(coefficients))
    r, q = sym(None, x, x.mT), None  # [n, m, m]
    for i, (a, b, c) in enumerate(coefficients):
        if i in restarts:
            x = q @ x
            r, q = sym(None, x, x.mT), None
        z = sym(r, r, r, beta=b, alpha=c)  # b R + c R^2
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)  # a I + Z
        else:
            q = sym(q, q, z, beta=a)  # a Q + Q Z
        if i + 1 < len(coefficients) and i + 1 not in restarts:
            rz = sym(r, r, z, beta=a)  # a R + R Z
            r = sym(rz, z, rz, beta=a)  # a RZ + Z RZ = (a I + Z) R (a I + Z)
    return (q @ x)[:, :m]


def ns_flops(short: int, long: int, steps: int, gram: bool = False, blocks: int = 1) -> int:
    """Matmul FLOPs of orthogonalising one [short, long] matrix (2 m k n per [m, k] x [k, n]): the
    standard form per iteration X X^T, R R and (.) X; the Gram form as `gram_orthogonalise` runs it,
    with `blocks` > 1 its symmetric products on the upper block triangle ((k + 1) / 2k of theirs, m padded
    to a multiple of k): 5 steps, m | k, (28 m^3 + 4 m^2 n) (k + 1) / 2k + 4 m^2 n."""
    m, n = padded(short, blocks), long
    if not gram:
        return steps * (4 * short * short * n + 2 * short ** 3)
    square, gram_matrix, general = symmetric_flops(m, m, blocks), symmetric_flops(m, n, blocks), 2 * m * m * n
    restarts = gram_restarts(steps)
    total = gram_matrix + general  # R = X X^T at the start, Q X at the end
    for i in range(steps):
        total += general + gram_matrix if i in restarts else 0  # X <- Q X, R <- X X^T
        total += square if i == 0 or i in restarts else 2 * square  # R^2; Q Z after the first of a run
        total += 2 * square if i + 1 < steps and i + 1 not in restarts else 0  # R Z, Z (R Z)
    return total


def step_ns_flops(shapes, steps: int, iteration: str, blocks: int = 1) -> int:
    """Matmul FLOPs of one optimizer step's orthogonalisation of matrices `shapes` [(A, B), ...] as `Muon.update`
    runs them with `optim.muon_iteration` (`blocks`: optim.muon_gram_blocks, read by gram_symmetric only): the
    same whatever the step's batch."""
    blocks = blocks if iteration == "gram_symmetric" else 1
    total = 0
    for a, b in shapes:
        m, n = min(a, b), max(a, b)
        gram = iteration in ("gram", "gram_symmetric") and uses_gram(m, n, steps, blocks)
        total += ns_flops(m, n, steps, gram=gram, blocks=blocks)
    return total


def describe_cost(shapes, steps: int, iteration: str, coefficients: str, blocks: int = 1) -> str:
    """The log line of what Muon's orthogonalisation costs a step (docs/PERF.md 3.7: at 4096-wide drafters it
    exceeds a 1-sequence DSpark step, so it is said where a run starts)."""
    tflop = step_ns_flops(shapes, steps, iteration, blocks) / 1e12
    hint = ""
    if (coefficients, steps) == ("torch", 5):
        hint = ("; optim.muon_coefficients=polar_express optim.muon_ns_steps=4 optim.muon_polar_lower=3e-3 runs one "
                "iteration fewer at equal tau (docs/LOG.md, sessions 30-31: two seeds on the CPU)")
    return (f"optim: Muon orthogonalises {len(shapes)} matrices a step: {tflop:.3g} TFLOP of matmuls ({iteration}, "
            f"{coefficients} x {steps}) whatever the step's batch, shared by its sequences (recipes.py){hint}")


def uses_gram(short: int, long: int, steps: int, blocks: int = 1) -> bool:
    """Whether `gram` (`gram_symmetric` with `blocks`) runs a [short, long] batch in the Gram form: when it
    takes fewer FLOPs than the standard form (5 steps: 28 m^3 + 8 m^2 n against 10 m^3 + 20 m^2 n, i.e.
    long > 1.5 short; symmetric at k = 4, 17.5 m^3 + 6.5 m^2 n: every shape, the square ones included)."""
    return ns_flops(short, long, steps, gram=True, blocks=blocks) < ns_flops(short, long, steps)


def _advance_momentum(grads, bufs, scale, keep, momentum: float) -> None:
    """buf <- lerp(buf, g / scale, 1 - momentum) where `keep`, else as it was (torch's arithmetic)."""
    for g, buf in zip(grads, bufs):
        buf.copy_(torch.where(keep, buf.lerp(g.float() / scale, 1 - momentum), buf))


def _nesterov_stack(grads, bufs, scale, momentum: float, tall: tuple) -> torch.Tensor:
    """[k, m, n] bf16 (m <= n): the Nesterov updates lerp(g / scale, buf, momentum) of one group's
    matrices, the tall ones transposed (torch's iteration transposes them too)."""
    updates = [(g.float() / scale).lerp(buf, momentum).bfloat16() for g, buf in zip(grads, bufs)]
    return torch.stack([u.mT if t else u for u, t in zip(updates, tall)])


def _apply_update(params, lows, orthos, decay, neg_lr, keep) -> None:
    """param <- param * decay - lr' * O where `keep`, then its bf16 copy. decay and neg_lr: Python
    floats eagerly (torch's own mul_ then add_(alpha=), which fuses the multiply-add on the CPU: the
    same bits as torch.optim.Muon), device tensors compiled."""
    for i, (p, o) in enumerate(zip(params, orthos)):
        new = (p * decay).add_(o, alpha=neg_lr) if isinstance(neg_lr, float) else p * decay + o.float() * neg_lr
        p.copy_(torch.where(keep, new, p))
        if lows is not None:
            lows[i].copy_(p)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update and state_dict layout (momentum_buffer per parameter; torch's group
    keys), stepped by `update` with the gradients given (module doc). `orthogonalised` counts the
    matrices this rank ran through the iteration. `gram_blocks`: `optim.muon_gram_blocks`, read by
    `gram_symmetric` only."""

    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float, ns_steps: int,
                 iteration: str = "newton_schulz", compiled: bool = False, gram_blocks: int = 1,
                 coefficients: str = "torch", polar_lower: float = PUBLISHED_LOWER):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True,
                                      ns_coefficients=TORCH_COEFFICIENTS, eps=EPS, ns_steps=ns_steps,
                                      adjust_lr_fn="match_rms_adamw"))
        if iteration not in ITERATIONS:
            raise ValueError(f"optim.muon_iteration={iteration!r}: expected one of {', '.join(ITERATIONS)}")
        self.schedule = ns_schedule(coefficients, ns_steps, polar_lower)
        self.gram = iteration in ("gram", "gram_symmetric")
        self.blocks = gram_blocks if iteration == "gram_symmetric" else 1
        if iteration == "gram_symmetric" and gram_blocks < 2:
            raise ValueError(f"optim.muon_iteration=gram_symmetric needs optim.muon_gram_blocks >= 2, got "
                             f"{gram_blocks} (1 block is optim.muon_iteration=gram)")
        self.compiled = compiled
        self.rank, self.world, self.group = 0, 1, None
        self.orthogonalised = 0
        make = (lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)) if compiled else (lambda fn: fn)
        self._momentum, self._nesterov, self._apply = make(_advance_momentum), make(_nesterov_stack), \
            make(_apply_update)
        for p in self.param_groups[0]["params"]:  # made now: a skipped first step must leave the state alone
            self._buffer(p)

    def spread(self, num_ranks: int, group=None) -> None:
        """Orthogonalise only this rank's share of the matrices from now on (`num_ranks` > 1)."""
        self.world, self.group = num_ranks, group
        self.rank = dist.get_rank(group) if num_ranks > 1 else 0

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        return state["momentum_buffer"]

    @torch.no_grad()
    def update(self, params: list, grads: list, scale: torch.Tensor, skip: torch.Tensor, lows: list | None = None):
        """One step of `params` (float32: the masters, or the module's own) from `grads` divided by
        `scale`, unless `skip` (a 0/1 device tensor) is 1; `lows`: bf16 module parameters that get
        the new weights. Same calls on every rank (the gather is collective)."""
        group = self.param_groups[0]
        keep, bufs = skip == 0, [self._buffer(p) for p in params]
        self._momentum(grads, bufs, scale, keep, group["momentum"])
        shapes = _by_shape(params)  # {(m, n): indices}, tall matrices counted as their transpose
        hyper = self._hyper(group, list(shapes), params[0].device)  # [decay, -lr' per group]
        tall = [p.shape[0] > p.shape[1] for p in params]
        for j, (shape, index) in enumerate(shapes.items()):
            mine = index[self._share(len(index))]
            ortho = None
            if mine:
                stacked = self._nesterov([grads[i] for i in mine], [bufs[i] for i in mine], scale, group["momentum"],
                                         tuple(tall[i] for i in mine))
                ortho = orthogonalise(stacked, *self.schedule, gram=self.gram, blocks=self.blocks)
                self.orthogonalised += len(mine)
            ortho = self._gathered(ortho, len(index), shape, params[0].device).unbind(0)
            self._apply([params[i] for i in index], None if lows is None else [lows[i] for i in index],
                        [o.mT if tall[i] else o for o, i in zip(ortho, index)], hyper[0], hyper[1 + j], keep)

    def _share(self, n: int) -> slice:
        per_rank = math.ceil(n / self.world)
        return slice(min(n, self.rank * per_rank), min(n, (self.rank + 1) * per_rank))

    def _gathered(self, ortho: torch.Tensor | None, n: int, shape, device) -> torch.Tensor:
        """Every rank's share in order, [n, A, B] (this rank's own with one rank)."""
        if self.world == 1:
            return ortho
        per_rank = math.ceil(n / self.world)
        mine = torch.zeros(per_rank, *shape, dtype=torch.bfloat16, device=device)
        if ortho is not None:
            mine[:ortho.shape[0]] = ortho
        every = torch.empty(per_rank * self.world, *shape, dtype=torch.bfloat16, device=device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        return every[:n]

    def _hyper(self, group: dict, shapes: list, device: torch.device):
        """[1 - lr * wd, -lr * 0.2 sqrt(max(A, B)) per shape], computed as torch's Muon does (Python
        floats); compiled, as float32 in one non-blocking copy (the update never recompiles)."""
        lr = group["lr"]
        values = [1 - lr * group["weight_decay"]] + [-(lr * 0.2 * math.sqrt(max(shape))) for shape in shapes]
        if not self.compiled:
            return values
        host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)


def _by_shape(params: list) -> dict:
    """{(short side, long side): [indices]} in order of first appearance: a tall matrix and the wide one
    of its transposed shape (gate/up and down projections) share one batch."""
    shapes: dict = {}
    for i, p in enumerate(params):
        shapes.setdefault(tuple(sorted(p.shape)), []).append(i)
    return shapes


class MuonAdamW(torch.optim.Optimizer):
    """Our Muon (`Muon`) over the hidden matrices (or their float32 masters) and an AdamW over the
    rest, as one optimizer: one LambdaLR scales both parts' lrs (`param_groups` are the parts' own
    groups), one state_dict, one step. The step divides every gradient by `grad_scale` and is
    skipped, exactly and on the device, when `found_inf` is 1 (both set by `step.clip_and_step` /
    `optim.step_unless`, as for the fused AdamW)."""

    def __init__(self, muon_params: list[torch.Tensor], adamw, *, master: bool, **muon_settings):
        """`muon_settings`: `Muon`'s keyword arguments (lr, weight_decay, momentum, ns_steps, iteration, ...)."""
        self.adamw = adamw  # MasterWeightAdamW (with `master`) or torch's AdamW, over the other parameters
        self.params = list(muon_params)  # the module's Muon parameters (bf16 with `master`)
        self.masters = [p.detach().float().clone() for p in self.params] if master else None
        self.muon = Muon(self.masters if master else self.params, **muon_settings)
        self.param_dtype = getattr(adamw, "param_dtype", None) if master else None
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        self.float32_grads = None  # grads.Float32Grads over every module parameter, when made
        super().__init__(self.muon.param_groups + adamw.param_groups, {})

    def module_params(self) -> list[torch.Tensor]:
        return self.params + [p for group in self.adamw.param_groups for p in group["params"]]

    def use_float32_grads(self, grads) -> None:
        self.float32_grads = grads
        self.adamw.use_float32_grads(grads)

    def spread_over_ranks(self, num_ranks: int, group=None) -> None:
        """Each drafter rank orthogonalises its share of the Muon matrices (`Muon.spread`)."""
        if (num_ranks, group) != (self.muon.world, self.muon.group):
            self.muon.spread(num_ranks, group)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        f32 = self.float32_grads
        return (f32.grad(p) if f32.has(p) else None) if f32 is not None else p.grad

    @torch.no_grad()
    def step(self, closure=None):
        device = self.params[0].device if self.params else None
        scale = self.grad_scale if self.grad_scale is not None else torch.ones((), device=device)
        skip = self.found_inf if self.found_inf is not None else torch.zeros((), device=device)
        self._step_adamw(scale, skip)
        pairs = [(i, g) for i, p in enumerate(self.params) if (g := self._grad(p)) is not None]
        if not pairs:
            return
        index, grads = [i for i, _ in pairs], [g for _, g in pairs]
        if self.masters is None:
            self.muon.update([self.params[i] for i in index], grads, scale, skip)
        else:
            self.muon.update([self.masters[i] for i in index], grads, scale, skip, [self.params[i] for i in index])
    def _step_adamw(self, scale: torch.Tensor, skip: torch.Tensor) -> None:
        part = self.adamw
        if hasattr(part, "found_inf") or part.defaults.get("fused"):  # decides on the device
            part.grad_scale, part.found_inf = scale, skip
            part.step()
            return
        grads = [p.grad for group in part.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, scale)
        if not bool(skip):
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        self.muon.zero_grad(set_to_none)
        for p in self.params:  # with masters, the module's own Muon parameters are in no group
            p.grad = None

    def state_dict(self) -> dict:
        return {"optimizer": "muon", "muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("optimizer") != "muon":
            raise ValueError("optim.name=muon cannot resume this checkpoint: its optimizer state is AdamW's "
                             "(resume with the optim.name it was trained with)")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups  # loading made new group dicts

    @contextlib.contextmanager
    def full_precision_weights(self):
        """Inside the block every parameter is its float32 master (see MasterWeightAdamW's)."""
        with contextlib.ExitStack() as stack:
            if hasattr(self.adamw, "full_precision_weights"):
                stack.enter_context(self.adamw.full_precision_weights())
            if self.masters is None:
                yield
                return
            low = [p.data for p in self.params]
            try:
                for p, master in zip(self.params, self.masters):
                    p.data = master
                yield
            finally:
                for p, data, master in zip(self.params, low, self.masters):
                    p.data = data
                    data.copy_(master)
