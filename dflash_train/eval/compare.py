"""Two eval reports side by side, prompt by prompt: is one drafter's tau really ahead of the other's?

Each set of an eval's report.json holds, per prompt, the tokens its verify steps emitted and how many steps
it took (`report.summarize`: "per_prompt"). Two runs evaluated on the same prompts (the same sets, number of
prompts and seed) pair up prompt by prompt. A set's tau is pooled (all emitted tokens over all steps), so the
uncertainty of a difference comes from a paired bootstrap over the prompts: the prompt indices are resampled
with replacement, the same indices for both runs, and the 2.5th and 97.5th percentiles of the pooled
difference bound it. Why: with 24 prompts a set, a repeat of the same recipe moves a set's tau by about 0.1
(docs/LOG.md, sessions 18-22), which is the size of most levers; six aggregate numbers cannot tell them apart.

    python bench/compare_reports.py runs/base/eval/report.json runs/gated/eval/report.json
"""

from __future__ import annotations

import random

RESAMPLES = 2000
OVERALL = "overall"


def pooled_tau(per_prompt: list, indices) -> float:
    """Emitted tokens over verify steps, pooled over the prompts `indices` (with repeats)."""
    emitted = sum(per_prompt[i][0] for i in indices)
    steps = sum(per_prompt[i][1] for i in indices)
    return emitted / steps if steps else 0.0


def paired_interval(a: list, b: list, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95 % interval of pooled tau(b) - tau(a) by a paired bootstrap over the prompts (deterministic per seed)."""
    rng, n = random.Random(seed), len(a)
    diffs = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        diffs.append(pooled_tau(b, pick) - pooled_tau(a, pick))
    diffs.sort()
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def _figures(report: dict, name: str) -> dict:
    return report[OVERALL] if name == OVERALL else report["sets"][name]


def compare(a: dict, b: dict, resamples: int = RESAMPLES, seed: int = 0) -> list[dict]:
    """One row per set both reports hold (A's order), then the overall row: both taus, the difference and, where
    both reports hold per-prompt figures, its paired 95 % interval and the prompts on which B is ahead or behind.
    Raises ValueError naming the set when the two runs did not decode the same number of prompts."""
    names = [name for name in a["sets"] if name in b["sets"]] + [OVERALL]
    rows = []
    for name in names:
        fa, fb = _figures(a, name), _figures(b, name)
        row = {"set": name, "tau_a": fa["tau"], "tau_b": fb["tau"], "diff": fb["tau"] - fa["tau"]}
        pa, pb = fa.get("per_prompt"), fb.get("per_prompt")
        if pa and pb:
            if len(pa) != len(pb):
                raise ValueError(f"set {name!r}: {len(pa)} prompts in A, {len(pb)} in B: compare runs evaluated on "
                                 f"the same prompts (eval.prompts, eval.num_prompts, eval.seed)")
            row["ci95"] = paired_interval(pa, pb, resamples, seed)
            row["b_ahead"] = sum(1 for x, y in zip(pa, pb) if y[0] * x[1] > x[0] * y[1])  # tau_b > tau_a, exactly
            row["b_behind"] = sum(1 for x, y in zip(pa, pb) if y[0] * x[1] < x[0] * y[1])
            row["prompts"] = len(pa)
        row["same_plain_tokens"] = fa.get("target_tokens") == fb.get("target_tokens")
        rows.append(row)
    return rows


def verdict(row: dict) -> str:
    """'B ahead' / 'B behind' where the interval excludes 0, 'undecided' where it holds it, '?' without one."""
    if "ci95" not in row:
        return "?"
    lo, hi = row["ci95"]
    return "B ahead" if lo > 0 else "B behind" if hi < 0 else "undecided"


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (what docs/LOG.md takes)."""
    lines = ["| set | A | B | B - A | 95 % interval (paired, prompts) | B ahead / behind (prompts) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = f"[{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]" if "ci95" in r else "no per-prompt figures"
        counts = f"{r['b_ahead']} / {r['b_behind']} of {r['prompts']}" if "ci95" in r else ""
        lines.append(f"| {r['set']} | {r['tau_a']:.3f} | {r['tau_b']:.3f} | {r['diff']:+.3f} | {ci} | {counts} | "
                     f"{verdict(r)} |")
    return "\n".join(lines)


def doubtful_pairings(rows: list[dict]) -> list[str]:
    """Sets whose plain greedy decodes differ in length between the runs: their prompts (or target) likely differ."""
    return [f"set {r['set']!r}: the plain decodes emitted different token counts, so the prompts or the target "
            f"likely differ and the pairing is doubtful" for r in rows if not r["same_plain_tokens"]]
