"""Batched products whose result is symmetric, computed on the upper block triangle only and mirrored
(`optim.muon_iteration=gram_symmetric`, train/optim/muon.py `gram_orthogonalise`).

Why they are symmetric: in the Gram form of Newton-Schulz every [m, m] iterate (R, Z = b R + c R^2,
Q, a I + Z) is a polynomial in the R = X X^T of its run, and polynomials in one matrix commute, so the
product of two of them is symmetric ((A B)^T = B A = A B); a restart's R = X X^T of the new X is a Gram
matrix. Only the final X <- Q X is a general product.

How: the m rows are cut into k blocks of s = m / k (the caller pads m to a multiple of k with zero
rows), and only the k (k + 1) / 2 blocks on and above the diagonal are computed: (k + 1) / 2k of the
FLOPs (62.5 % at k = 4, 56 % at k = 8), then each block above the diagonal is copied, transposed,
below it. One baddbmm per block row i, over every matrix of the batch: rows i of A [n, s, K] times
columns i.. of B [n, K, (k - i) s], both views of the operands, written in place into the result's
block row. Not one bmm over all k (k + 1) / 2 block pairs: gathering the pairs' operands copies each
operand (k + 1) / 2 times, ~13 m^2 elements moved per product at k = 4; at m = 4096 on an H200 (~4.8
TB/s, ~770 TFLOP/s) that is ~half the time of the full product, more than the 3/8 the triangle saves.
Here the extra traffic is the mirror (~1.1 m^2 element reads and writes; docs/PERF.md 3.7).
"""

from __future__ import annotations

import torch


def padded(m: int, blocks: int) -> int:
    """The rows m is padded to so that `blocks` blocks divide it (m itself at blocks = 1)."""
    return blocks * -(-m // blocks)


def symmetric_flops(rows: int, inner: int, blocks: int) -> int:
    """Matmul FLOPs of `symmetric_baddbmm` for one [rows, inner] x [inner, rows] product (rows padded):
    k (k + 1) / 2 blocks of 2 s^2 inner each, i.e. 2 m^2 inner at k = 1."""
    s = -(-rows // blocks)
    return blocks * (blocks + 1) * s * s * inner


def symmetric_baddbmm(c: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0,
                      alpha: float = 1.0, blocks: int = 1) -> torch.Tensor:
    """beta C + alpha A B for a batch whose results are symmetric: a [n, m, K], b [n, K, m], c [n, m, m]
    or None (A B alone), m a multiple of `blocks`. At blocks = 1 the plain product (`@`, or one
    torch.baddbmm), bit for bit; else the upper block triangle (module doc), mirrored."""
    if blocks == 1:
        return a @ b if c is None else torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
    n, m = a.shape[0], a.shape[-2]
    if m % blocks:
        raise ValueError(f"symmetric_baddbmm: {m} rows do not split into {blocks} blocks (pad them first)")
    s = m // blocks
    out = torch.empty(n, m, m, dtype=a.dtype, device=a.device) if c is None else c.clone(
        memory_format=torch.contiguous_format)
    for i in range(blocks):
        row = out[:, i * s:(i + 1) * s, i * s:]  # [n, s, (k - i) s], a view: the product lands in place
        torch.baddbmm(row, a[:, i * s:(i + 1) * s], b[:, :, i * s:], beta=0.0 if c is None else beta,
                      alpha=alpha, out=row)
    mirror(out, blocks)
    return out


def mirror(x: torch.Tensor, blocks: int) -> None:
    """In place on [n, m, m]: every block below the diagonal <- the transpose of its mirror image above."""
    n, m = x.shape[0], x.shape[-1]
    s = m // blocks
    i, j = torch.triu_indices(blocks, blocks, 1, device=x.device)  # the blocks (i, j) above: i < j
    grid = x.view(n, blocks, s, blocks, s)  # [n, block row, row, block column, column]
    grid[:, j, :, i, :] = grid[:, i, :, j, :].transpose(-1, -2)
