"""Two eval reports compared prompt by prompt (dflash_train/eval/compare.py, bench/compare_reports.py): the
pooled taus against a direct sum, the paired bootstrap against the cases whose answer is known, and the
errors a mismatched pair must raise."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.eval.compare import compare, doubtful_pairings, paired_interval, pooled_tau, table, verdict

REPO = Path(__file__).resolve().parents[2]


def _report(sets: dict[str, list], plain_tokens: int = 64) -> dict:
    """A report as `evaluate` writes one: per set its pooled tau and per-prompt [emitted, steps]."""
    def figures(per_prompt):
        return {"tau": pooled_tau(per_prompt, range(len(per_prompt))), "per_prompt": per_prompt,
                "target_tokens": plain_tokens}
    everything = [p for per_prompt in sets.values() for p in per_prompt]
    return {"sets": {name: figures(pp) for name, pp in sets.items()}, "overall": figures(everything)}


def test_the_pooled_tau_is_emitted_over_steps_with_repeats():
    per_prompt = [[10, 5], [30, 6], [8, 8]]
    assert pooled_tau(per_prompt, [0, 1, 2]) == pytest.approx(48 / 19)
    assert pooled_tau(per_prompt, [1, 1, 2]) == pytest.approx(68 / 20)  # a resample repeats prompts


def test_identical_runs_differ_by_nothing_and_are_undecided():
    per_prompt = [[20 + i, 10] for i in range(24)]
    rows = compare(_report({"chat": per_prompt}), _report({"chat": per_prompt}))
    assert [r["set"] for r in rows] == ["chat", "overall"]
    assert rows[0]["diff"] == 0 and rows[0]["ci95"] == (0.0, 0.0) and verdict(rows[0]) == "undecided"
    assert (rows[0]["b_ahead"], rows[0]["b_behind"], rows[0]["prompts"]) == (0, 0, 24)


def test_a_run_ahead_on_every_prompt_is_ahead_and_one_ahead_on_half_is_undecided():
    base = [[20 + (i % 7), 10] for i in range(24)]
    better = [[e + 3, n] for e, n in base]  # +0.3 tau on every prompt
    mixed = [[e + (6 if i % 2 else -6), n] for i, (e, n) in enumerate(base)]  # +0.6 on half, -0.6 on half
    ahead = compare(_report({"chat": base}), _report({"chat": better}))[0]
    assert ahead["diff"] == pytest.approx(0.3) and ahead["ci95"][0] > 0 and verdict(ahead) == "B ahead"
    assert ahead["b_ahead"] == 24 and ahead["b_behind"] == 0
    behind = compare(_report({"chat": better}), _report({"chat": base}))[0]
    assert verdict(behind) == "B behind" and behind["ci95"][1] < 0
    split = compare(_report({"chat": base}), _report({"chat": mixed}))[0]
    assert split["ci95"][0] < 0 < split["ci95"][1] and verdict(split) == "undecided"


def test_the_interval_is_the_bootstraps_percentiles_and_is_seeded():
    a = [[20, 10], [25, 10], [30, 10], [22, 10]]
    b = [[24, 10], [25, 10], [31, 10], [30, 10]]
    assert paired_interval(a, b, 500, seed=3) == paired_interval(a, b, 500, seed=3)
    lo, hi = paired_interval(a, b, 500, seed=3)
    diffs = [(y[0] - x[0]) / 10 for x, y in zip(a, b)]  # equal steps: the pooled difference is a prompt mean
    assert min(diffs) <= lo <= hi <= max(diffs)


def test_a_pair_that_decoded_different_prompt_counts_is_refused_naming_the_set():
    with pytest.raises(ValueError, match="set 'code': 24 prompts in A, 12 in B"):
        compare(_report({"code": [[20, 10]] * 24}), _report({"code": [[20, 10]] * 12}))


def test_old_reports_compare_by_their_taus_and_doubtful_pairings_are_said():
    old = _report({"chat": [[20, 10]] * 4})
    for figures in (*old["sets"].values(), old["overall"]):
        del figures["per_prompt"]
    rows = compare(old, _report({"chat": [[22, 10]] * 4}, plain_tokens=60))
    assert "ci95" not in rows[0] and verdict(rows[0]) == "?" and rows[0]["diff"] == pytest.approx(0.2)
    assert "no per-prompt figures" in table(rows)
    assert doubtful_pairings(rows) and "set 'chat'" in doubtful_pairings(rows)[0]


def test_the_bench_prints_the_table_and_a_verdict(tmp_path):
    base = [[20 + (i % 5), 10] for i in range(24)]
    paths = []
    for name, pp in (("a", base), ("b", [[e + 4, n] for e, n in base])):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(_report({"chat": pp, "code": base})))
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "bench/compare_reports.py", *map(str, paths), "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| chat | 2.192 | 2.592 | +0.400 |" in run.stdout  # 526 and 622 tokens in 240 steps
    assert "VERDICT compare_reports: OK: of 2 sets: B ahead on 1, undecided on 1" in run.stdout
    assert json.loads(out.read_text())["info"]["rows"][0]["set"] == "chat"
    bad = subprocess.run([sys.executable, "bench/compare_reports.py", str(paths[0]), str(tmp_path / "missing.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "missing.json" in bad.stdout


def test_ab_arms_compares_each_arm_with_the_first_prompt_by_prompt(tmp_path, capsys):
    from bench.ab_arms import against_first

    base = [[20 + (i % 5), 10] for i in range(24)]
    for name, pp in (("base", base), ("better", [[e + 4, n] for e, n in base])):
        (tmp_path / name / "eval").mkdir(parents=True)
        (tmp_path / name / "eval" / "report.json").write_text(json.dumps(_report({"chat": pp})))
    rows = against_first(tmp_path, ["base", "better", "crashed"])  # an arm without a report is left out
    assert [(r["arm"], r["against"]) for r in rows] == [("better", "base")]
    assert verdict(rows[0]["sets"][0]) == "B ahead" and "ab: better against base:" in capsys.readouterr().out
    assert against_first(tmp_path, ["crashed", "base"]) == []  # no baseline report: nothing to compare
