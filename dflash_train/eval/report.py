"""Acceptance statistics, the eval report (report.json), plots and the printed summary table.

Definitions (per set of prompts, pooled over all verification steps of all prompts):
- `acc` of a step = draft tokens the target accepted, 0..B-1; the step emits acc + 1 tokens.
- tau = mean(acc + 1) = tokens produced per target verification forward (the paper's acceptance
  length). Equivalently tau = 1 + sum_k per_position[k].
- per_position[k] (k = 1..B-1) = fraction of steps whose draft slot k was accepted (acc >= k).
- histogram[j] (j = 0..B-1) = number of steps with acc == j.
- tokens/s = generated tokens / wall seconds (prefill included) summed over the set's prompts, for
  speculative and plain target decoding alike; speedup = their ratio.
- cycle = the wall time of one draft+verify cycle in plain decode steps, each decoder's time to its
  first token (the prefill) left out: ((spec s - spec prefill s) / steps) / ((target s - target
  prefill s) / target steps), a plain step being each token after the prefill's. What a cycle costs
  on this machine, whatever the drafter's quality. The prefills stay in the speedup: on 64-token
  outputs a speculative prefill (which also taps the context) weighs on ~tau x fewer cycles.
- cycle_outliers = the prompts whose own cycle is OUTLIER_FACTOR x off the set's median: timed while something
  else held the machine (a stall inside one decoder counts against that side only), named in a printed note.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Sequence

from dflash_train.eval.spec_decode import GenResult, SpecResult

PER_POSITION_PNG = "acceptance_per_position.png"
HISTOGRAM_PNG = "accepted_length_hist.png"


def acceptance_stats(accepted: Sequence[int], block_size: int) -> dict:
    """tau, per-position acceptance and the accepted-length histogram of a list of steps."""
    n = len(accepted)
    if any(not 0 <= a < block_size for a in accepted):
        raise ValueError(f"accepted counts must lie in [0, {block_size - 1}] for block size {block_size}")
    histogram = [sum(1 for a in accepted if a == j) for j in range(block_size)]
    per_position = [sum(1 for a in accepted if a >= k) / n if n else 0.0 for k in range(1, block_size)]
    tau = sum(a + 1 for a in accepted) / n if n else 0.0
    return {"tau": tau, "steps": n, "per_position_acceptance": per_position,
            "accepted_length_histogram": histogram}


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def summarize(spec: Sequence[SpecResult], plain: Sequence[GenResult], block_size: int) -> dict:
    """One set's figures: acceptance stats, tokens/s of both decoders, speedup, identical outputs."""
    stats = acceptance_stats([a for r in spec for a in r.accepted], block_size)
    spec_tokens, spec_s = sum(len(r.tokens) for r in spec), sum(r.seconds for r in spec)
    plain_tokens, plain_s = sum(len(r.tokens) for r in plain), sum(r.seconds for r in plain)
    spec_pre, plain_pre = sum(r.prefill_seconds for r in spec), sum(r.prefill_seconds for r in plain)
    plain_steps = sum(max(len(r.tokens) - 1, 0) for r in plain)
    spec_rate, plain_rate = _rate(spec_tokens, spec_s), _rate(plain_tokens, plain_s)
    return {
        "num_prompts": len(spec),
        **stats,
        "spec_tokens": spec_tokens,
        "spec_seconds": spec_s,
        "spec_tokens_per_s": spec_rate,
        "target_tokens": plain_tokens,
        "target_seconds": plain_s,
        "target_tokens_per_s": plain_rate,
        "speedup": spec_rate / plain_rate if plain_rate else 0.0,
        "spec_prefill_seconds": spec_pre,
        "target_prefill_seconds": plain_pre,
        "cycle_plain_steps": _cycle(spec_s - spec_pre, stats["steps"], plain_s - plain_pre, plain_steps) or 0.0,
        # Greedy spec decoding must reproduce the target; in bf16 a near-tie can flip one token.
        "identical_outputs": sum(1 for s, p in zip(spec, plain) if s.tokens == p.tokens),
        "cycle_outliers": cycle_outliers(spec, plain),
        # per prompt [tokens the verify steps emitted, steps]: what `eval/compare.py` pairs between two reports
        "per_prompt": [[sum(a + 1 for a in r.accepted), len(r.accepted)] for r in spec],
    }


OUTLIER_FACTOR = 2.0
"""A prompt whose own cycle (in its own plain steps) is this many times the set's median, or that many times below
it, was timed while something else held the machine: a cycle's cost depends on the machine, not on the prompt."""


def _cycle(spec_s: float, steps: int, plain_s: float, plain_steps: int) -> float | None:
    """Seconds a draft+verify cycle over seconds a plain step, prefills already left out (None: no cycle)."""
    if steps <= 0 or plain_steps <= 0 or spec_s <= 0 or plain_s <= 0:
        return None
    return (spec_s / steps) / (plain_s / plain_steps)


def prompt_cycle(spec: SpecResult, plain: GenResult) -> float | None:
    """One prompt's draft+verify cycle in its own plain decode's steps, the prefills left out (None: no cycle)."""
    return _cycle(spec.seconds - spec.prefill_seconds, len(spec.accepted), plain.seconds - plain.prefill_seconds,
                  len(plain.tokens) - 1)


def cycle_outliers(spec: Sequence[SpecResult], plain: Sequence[GenResult]) -> list[dict]:
    """The prompts (index in the set, cycle, the set's median cycle) whose cycle is OUTLIER_FACTOR x off the median
    of at least 3 prompts: a stall inside one decoder's timing, which the pooled speedup cannot tell from a slow
    drafter."""
    cycles = [(i, c) for i, (s, p) in enumerate(zip(spec, plain)) if (c := prompt_cycle(s, p)) is not None]
    if len(cycles) < 3:
        return []
    median = statistics.median(c for _, c in cycles)
    return [{"prompt": i, "cycle_plain_steps": c, "median_cycle_plain_steps": median} for i, c in cycles
            if c > OUTLIER_FACTOR * median or c * OUTLIER_FACTOR < median]


def timing_note(figures: dict) -> str | None:
    """A note naming the prompts timed during a stall (`cycle_outliers`), so a busy machine is not read as a slow
    drafter; None when there were none."""
    outliers = figures.get("cycle_outliers") or []
    if not outliers:
        return None
    which = ", ".join(f"prompt {o['prompt']}: {o['cycle_plain_steps']:.2f}" for o in outliers)
    return (f"timing: {len(outliers)} prompt(s) decoded at a cycle far from the set's median "
            f"{outliers[0]['median_cycle_plain_steps']:.2f} plain steps ({which}); a cycle's cost depends on the "
            f"machine, not the prompt, so something else ran meanwhile and this set's speedup is off by it: "
            f"rerun `dflash-train eval` on a quiet machine for a clean figure")


def write_json(report: dict, out_dir: Path) -> Path:
    """report.json, written to a temp name and renamed so readers never see half a file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def plot(sets: dict[str, dict], out_dir: Path) -> list[Path]:
    """Per-position acceptance (lines) and accepted-length distribution (bars), sets overlaid."""
    import matplotlib  # local: a heavy import (~1 s) that only the plots need

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in sets.items():
        ks = list(range(1, len(s["per_position_acceptance"]) + 1))
        ax.plot(ks, s["per_position_acceptance"], marker="o", label=f"{name} (tau {s['tau']:.2f})")
    ax.set(xlabel="draft slot k", ylabel="fraction of steps with slot k accepted", ylim=(0, 1.02),
           title="DFlash per-position acceptance")
    ax.grid(alpha=0.3)
    ax.legend()
    paths = [out_dir / PER_POSITION_PNG]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(sets))
    for i, (name, s) in enumerate(sets.items()):
        hist, steps = s["accepted_length_histogram"], max(1, s["steps"])
        xs = [j + 1 + (i - (len(sets) - 1) / 2) * width for j in range(len(hist))]
        ax.bar(xs, [h / steps for h in hist], width=width, label=name)
    ax.set(xlabel="tokens per verification (accepted + 1)", ylabel="fraction of steps",
           title="DFlash accepted-length distribution")
    ax.legend()
    paths.append(out_dir / HISTOGRAM_PNG)
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def lossless_note(figures: dict, float32: bool, temperature: float) -> str | None:
    """A note when greedy speculative decoding left plain greedy decoding at explained near-ties (any
    other divergence has already failed the eval: eval/lossless.py); None when every output matched
    (or sampling makes matching meaningless)."""
    differ = figures["num_prompts"] - figures["identical_outputs"]
    if differ == 0 or temperature > 0:
        return None
    why = ("a true tie in float32" if float32 else
           "the batched verify forward and the one-token step round differently in reduced precision; decoding "
           "in float32 (eval.dtype=float32) gives identical outputs")
    return (f"{differ} of {figures['num_prompts']} outputs leave plain greedy decoding at a near-tie (the verify "
            f"pass's top-2 logit gap at the first divergence <= {figures.get('near_tie_max_gap', 0.0):.3g}): {why}")


def summary_table(sets: dict[str, dict]) -> str:
    """Fixed-width table: one row per set, acceptance of the first slots included."""
    head = f"{'set':<12}{'prompts':>8}{'tokens':>8}{'steps':>7}{'tau':>7}  {'acc@1..4':<24}" \
           f"{'spec tok/s':>11}{'target tok/s':>13}{'speedup':>9}{'cycle':>7}{'same':>6}"
    with_sim = any("sim_tau" in s for s in sets.values())
    head += f"{'sim tau':>9}" if with_sim else ""
    rows = [head, "-" * len(head)]
    for name, s in sets.items():
        acc = " ".join(f"{a:.2f}" for a in s["per_position_acceptance"][:4])
        sim = (f"{s['sim_tau']:>9.2f}" if "sim_tau" in s else f"{'-':>9}") if with_sim else ""
        rows.append(f"{name:<12}{s['num_prompts']:>8}{s['spec_tokens']:>8}{s['steps']:>7}{s['tau']:>7.2f}  "
                    f"{acc:<24}{s['spec_tokens_per_s']:>11.1f}{s['target_tokens_per_s']:>13.1f}"
                    f"{s['speedup']:>8.2f}x{s.get('cycle_plain_steps', 0.0):>7.2f}{s['identical_outputs']:>6}{sim}")
    return "\n".join(rows)
