"""Muon's orthogonalisation per `optim.muon_iteration`: how close each form comes to the float64
polynomial on gradient-like matrices, and its time per optimizer step at the drafter's matrix shapes.

    python bench/muon_iterations.py                # one GPU: the paper drafter's 36 matrices (4 batches)
    python bench/muon_iterations.py --small        # tiny shapes on the CPU (seconds)
    python bench/muon_iterations.py --device cpu --divide 8    # the paper's aspect ratios at 1/8 (CPU, minutes)
    python bench/muon_iterations.py --gram-blocks 4,8          # gram_symmetric at 4 and at 8 blocks
    python bench/muon_iterations.py --coefficients polar_express --ns-steps 4 --polar-lower 3e-3  # a 4-step schedule

Quality: one matrix of each shape the drafter's Muon orthogonalises (the short side first), of three
kinds (Gaussian; singular values log-spaced over 3 decades; rank 32 plus noise at 1e-3 of the top
singular value), rounded to bf16 as Muon's Nesterov stack hands it over. Each form (`newton_schulz`:
the standard form in bf16; `gram`: the Gram form in float16 where `uses_gram` picks it, as on CUDA,
on every device; `gram_symmetric_k<k>`: the same with its symmetric products on the upper block
triangle of k blocks, where `uses_gram` picks it at that k, the square matrices too) against torch's
quintic run in float64 on the same input: the relative Frobenius error, and the range of the result's
singular values beside the float64 polynomial's. A Gram form is of equal quality here when its error
is at most the standard form's on every matrix it runs.
Time: each form over the step's batches (same-shape matrices stacked, as `muon.Muon.update` runs
them on one rank), CUDA-synchronised, median of --reps; the FLOPs are `muon.ns_flops`'.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import _common as C  # noqa: E402
from bench.flops import PAPER, SMALL, drafter_matrix_shapes  # noqa: E402
from dflash_train.config import OptimConfig  # noqa: E402
from dflash_train.train.optim.muon import (COEFFICIENTS, gram_orthogonalise, ns_flops,  # noqa: E402
                                           ns_schedule, orthogonalise, uses_gram)

BASE_FORMS = ("newton_schulz", "gram")  # then gram_symmetric_k<k> per --gram-blocks
KINDS = ("gaussian", "decades3", "rank32_noise")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU (seconds)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--ns-steps", type=int, default=5, help="optim.muon_ns_steps (default 5)")
    p.add_argument("--coefficients", choices=COEFFICIENTS, default="torch", help="optim.muon_coefficients")
    p.add_argument("--polar-lower", type=float, default=OptimConfig().muon_polar_lower,
                   help="optim.muon_polar_lower (--coefficients polar_express)")
    p.add_argument("--reps", type=int, help="timed calls per batch (default 5; 1 with --small)")
    p.add_argument("--divide", type=int, default=1, help="every matrix side divided by this (aspect ratios kept)")
    p.add_argument("--gram-blocks", default=str(OptimConfig().muon_gram_blocks),
                   help="comma-separated block counts of gram_symmetric's forms (default optim.muon_gram_blocks)")
    p.add_argument("--no-quality", action="store_true", help="time only")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    a.reps = a.reps or (1 if a.small else 5)
    a.forms = BASE_FORMS + tuple(f"gram_symmetric_k{int(k)}" for k in a.gram_blocks.split(","))
    if any(blocks_of(form) < 2 for form in a.forms[2:]):
        p.error(f"--gram-blocks {a.gram_blocks}: every block count must be >= 2 (1 block is the form gram)")
    return a


def blocks_of(form: str) -> int:
    """The block count of a form: k of gram_symmetric_k<k>, 1 for the others."""
    return int(form.rsplit("_k", 1)[1]) if form.startswith("gram_symmetric") else 1


def runs_gram(form: str, m: int, n: int, steps: int) -> bool:
    """Whether the form runs an [m, n] batch in the Gram form (`uses_gram` at its block count)."""
    return form != "newton_schulz" and uses_gram(m, n, steps, blocks_of(form))


def batches(small: bool, divide: int = 1) -> dict[tuple[int, int], int]:
    """{(short, long): matrices} of the drafter's Muon step, grouped as `muon._by_shape` groups them,
    each side divided by `divide`."""
    s = SMALL if small else PAPER
    shapes = drafter_matrix_shapes(s["hidden"], s["num_heads"], s["num_kv_heads"], s["head_dim"], s["intermediate"],
                                   s["drafter_layers"], len(s["tap_layers"]))
    groups: dict = {}
    for a, b in shapes:
        key = (min(a, b) // divide, max(a, b) // divide)
        groups[key] = groups.get(key, 0) + 1
    return groups


def gradient_like(kind: str, m: int, n: int, device, gen) -> torch.Tensor:
    """[1, m, n] bf16 of one kind (module doc), scaled like a gradient (~1e-3)."""
    if kind == "gaussian":
        x = torch.randn(m, n, generator=gen, device=device)
    elif kind == "decades3":
        u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, device=device))
        v, _ = torch.linalg.qr(torch.randn(n, m, generator=gen, device=device))
        x = (u * torch.logspace(0, -3, m, device=device)) @ v.T
    else:
        k = min(32, m // 2)
        u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, device=device))
        v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, device=device))
        x = (u * torch.logspace(0, -1, k, device=device)) @ v.T
        x = x + 1e-3 * torch.randn(m, n, generator=gen, device=device) / n ** 0.5
    return (1e-3 * x / x.norm() * (m * n) ** 0.5)[None].bfloat16()


def orthogonalised(x: torch.Tensor, form: str, coefficients, safety: float) -> torch.Tensor:
    """The form's result, the Gram form always in float16 (what CUDA runs)."""
    if runs_gram(form, *x.shape[-2:], len(coefficients)):
        return gram_orthogonalise(x, coefficients, safety, dtype=torch.float16, blocks=blocks_of(form))
    return orthogonalise(x, coefficients, safety)


def float64_polynomial(x: torch.Tensor, coefficients, safety: float) -> torch.Tensor:
    x = x.double()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * safety)
    for a, b, c in coefficients:
        g = x @ x.mT
        x = a * x + (b * g + c * g @ g) @ x
    return x


def singular_range(x: torch.Tensor) -> tuple[float, float]:
    """(min, max) singular value of [1, m, n] (m <= n), from the eigenvalues of X X^T in float64."""
    x = x.double()[0]
    s = torch.linalg.eigvalsh(x @ x.T).clamp(min=0).sqrt()
    return float(s.min()), float(s.max())


def quality(b: C.Bench, groups: dict, schedule, device, forms) -> None:
    coefficients, safety = schedule
    gen = torch.Generator(device=device).manual_seed(0)
    ratios, worst = {form: [] for form in forms[1:]}, {form: 0.0 for form in forms}
    for (m, n) in groups:
        for kind in KINDS:
            x = gradient_like(kind, m, n, device, gen)
            ref = float64_polynomial(x, coefficients, safety)
            low, high = singular_range(ref)
            line, errors = f"{m}x{n} {kind}: float64 s [{low:.3f}, {high:.3f}]", {}
            for form in forms:
                out = orthogonalised(x, form, coefficients, safety)
                errors[form] = float((out.double() - ref).norm() / ref.norm())
                worst[form] = max(worst[form], errors[form])
                low, high = singular_range(out)
                line += f" | {form} s [{low:.3f}, {high:.3f}] error {errors[form]:.4f}"
            for form in forms[1:]:
                if runs_gram(form, m, n, len(coefficients)):
                    ratios[form].append(errors[form] / errors["newton_schulz"])
            b.log(line)
    for form in forms:
        b.figure(f"error_max_{form}", worst[form],
                 "relative Frobenius error against the float64 polynomial, worst matrix")
    for form in forms[1:]:
        if ratios[form]:
            b.figure(f"{form}_error_ratio_max", max(ratios[form]), f"worst {form} / newton_schulz error where the "
                     "Gram form runs (<= 1: equal quality)")


def timing(b: C.Bench, groups: dict, schedule, device, reps: int, forms) -> None:
    coefficients, safety = schedule
    steps = len(coefficients)
    for form in forms:
        total_s, total_flops = 0.0, 0.0
        C.reset_peak_memory(device)
        for (m, n), count in groups.items():
            x = torch.randn(count, m, n, device=device, dtype=torch.bfloat16) * 1e-3
            gram, blocks = form != "newton_schulz", blocks_of(form)
            run = lambda: orthogonalise(x, coefficients, safety, gram=gram, blocks=blocks)  # noqa: E731
            run()
            seconds = C.median(C.time_calls(run, reps, device))
            flops = count * ns_flops(m, n, steps, gram=runs_gram(form, m, n, steps), blocks=blocks_of(form))
            b.log(f"{form}: {count} x [{m}, {n}] in {seconds * 1e3:.2f} ms, {flops / seconds / 1e12:.1f} TFLOP/s")
            total_s, total_flops = total_s + seconds, total_flops + flops
        b.figure(f"step_ms_{form}", total_s * 1e3, f"{total_flops / 1e12:.4g} TFLOP, one rank, every batch")
        b.figure(f"tflops_{form}", total_flops / total_s / 1e12)
        if device.type == "cuda":
            b.figure(f"peak_memory_gib_{form}", C.peak_memory_gib(device), "the batches' inputs included")
    for form in forms[1:]:
        b.figure(f"{form}_speedup", b.figures["step_ms_newton_schulz"] / b.figures[f"step_ms_{form}"],
                 "newton_schulz's time / this form's")


def main(argv=None) -> int:
    a = parse(argv)
    b, device = C.start("muon_iterations", a)
    groups, schedule = batches(a.small, a.divide), ns_schedule(a.coefficients, a.ns_steps, a.polar_lower)
    lower = f" from {a.polar_lower:g}" if a.coefficients == "polar_express" else ""
    b.log(f"device {device}; batches {', '.join(f'{k} x {m}x{n}' for (m, n), k in groups.items())}; "
          f"{a.ns_steps} iterations of the {a.coefficients} coefficients{lower}")
    if device.type == "cuda":
        with b.phase("peak"):
            b.figure("matmul_peak_tflops", C.measure_matmul_peak(device, b)[0] / 1e12)
    if not a.no_quality:
        with b.phase("quality"):
            quality(b, groups, schedule, device, a.forms)
    with b.phase("timing"):
        timing(b, groups, schedule, device, a.reps, a.forms)
    f = b.figures
    verdict = ", ".join(f"{form} {f[f'step_ms_{form}']:.1f} ms" for form in a.forms if f"step_ms_{form}" in f)
    for form in a.forms[1:]:
        ratio = f.get(f"{form}_error_ratio_max")
        if ratio is None:
            continue
        verdict += (f"; {form}'s error <= newton_schulz's on every matrix (worst ratio {ratio:.2f})" if ratio <= 1.0
                    else f"; {form}'s error ABOVE newton_schulz's (worst ratio {ratio:.2f})")
        if ratio > 1.0:
            b.failed.append(f"quality {form}")
    return b.finish(verdict, a.json)


if __name__ == "__main__":
    sys.exit(main())
