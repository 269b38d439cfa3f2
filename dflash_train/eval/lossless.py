"""The eval's losslessness verdict: greedy speculative decoding must reproduce plain greedy decoding.

In float32 the two decoders agree token for token up to true ties. In reduced precision the verify
pass (the anchor and the drafts in one forward) and the one-token plain step round differently, so an
argmax whose top two logits are nearly equal can flip, and from there the two texts part. Such a
divergence is accepted only as an explained near-tie: at the first position where the outputs differ,
the verify pass's top-2 logit gap (`SpecResult.gaps`, the row the speculative token was taken from)
is under the tolerance (`eval.near_tie_gap`, or `eval.near_tie_gap_float32` for a float32 target).
Anything else is a bug in the decoder, and the eval fails naming the prompt set, the prompt's index,
the position and the gap. Sampled decoding (temperature > 0) is exempt: its outputs differ by design.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_train.config import EvalConfig


class LosslessError(RuntimeError):
    """A greedy speculative output left plain greedy decoding where no near-tie explains it."""

    readable = True  # cli prints the message alone as the FAILED verdict


def tolerance(dtype: torch.dtype, near_tie_gap: float = EvalConfig.near_tie_gap,
              near_tie_gap_float32: float = EvalConfig.near_tie_gap_float32) -> float:
    """The top-2 logit gap under which a divergence is a near-tie, for a target of this dtype."""
    return near_tie_gap_float32 if dtype in (torch.float32, torch.float64) else near_tie_gap


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two outputs differ (one ending early counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Verdict:
    """Per set, the explained near-ties' gaps; every unexplained divergence as a sentence."""

    near_ties: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def figures(self, name: str) -> dict:
        gaps = self.near_ties.get(name, [])
        return {"near_ties": len(gaps), "near_tie_max_gap": max(gaps, default=0.0)}


def check(results: dict, tol: float, temperature: float) -> Verdict:
    """`results` {set: (spec results, plain results)} as evaluate decodes them -> the verdict."""
    verdict = Verdict()
    for name, (spec, plain) in results.items():
        verdict.near_ties[name] = []
        if temperature > 0:
            continue
        for index, (s, p) in enumerate(zip(spec, plain)):
            at = first_divergence(s.tokens, p.tokens)
            if at is None:
                continue
            gap = s.gaps[at] if s.gaps is not None and at < len(s.gaps) else float("inf")
            if gap < tol:
                verdict.near_ties[name].append(gap)
                continue
            ours = s.tokens[at] if at < len(s.tokens) else "(end)"
            theirs = p.tokens[at] if at < len(p.tokens) else "(end)"
            verdict.failures.append(
                f"set {name!r} prompt {index} position {at}: the speculative output has token {ours} where plain "
                f"greedy decoding has {theirs}, and the verify pass's top-2 logit gap there is {gap:.4g} >= the "
                f"near-tie tolerance {tol:g} (eval.near_tie_gap): a decoder bug, not a near-tie")
    return verdict


def apply(report: dict, verdict: Verdict, tol: float) -> None:
    """Record the near-tie counts in the report (per set and overall) and the tolerance used."""
    for name, figures in report["sets"].items():
        figures.update(verdict.figures(name))
    every = [g for gaps in verdict.near_ties.values() for g in gaps]
    report["overall"].update({"near_ties": len(every), "near_tie_max_gap": max(every, default=0.0)})
    report["near_tie_tolerance"] = tol
    report["unexplained_divergences"] = len(verdict.failures)


def raise_on_failures(verdict: Verdict, report_path: str | None) -> None:
    if verdict.failures:
        more = f" (and {len(verdict.failures) - 1} more)" if len(verdict.failures) > 1 else ""
        where = f"; report {report_path}" if report_path else ""
        raise LosslessError(f"eval: not lossless: {verdict.failures[0]}{more}{where}")
