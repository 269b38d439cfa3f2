"""Two runs' eval reports prompt by prompt: which sets does B really win, lose, or leave undecided?

A and B are `eval/report.json` files of runs evaluated on the same prompts (e.g. an arm and its baseline on
one machine). Per set: both taus, B - A, its 95 % interval by a paired bootstrap over the prompts, and the
prompts on which B is ahead or behind (dflash_train/eval/compare.py). Reports written before session 26
hold no per-prompt figures: their rows show the difference alone.

    python bench/compare_reports.py runs/base/eval/report.json runs/gated/eval/report.json [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._bench import Bench, say  # noqa: E402
from dflash_train.eval.compare import RESAMPLES, compare, doubtful_pairings, table, verdict  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="the baseline's eval/report.json")
    p.add_argument("b", help="the arm's eval/report.json")
    p.add_argument("--resamples", type=int, default=RESAMPLES, help="bootstrap resamples (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    b = Bench("compare_reports", a)
    rows = []
    with b.phase("compare"):
        reports = [json.loads(Path(path).read_text()) for path in (a.a, a.b)]
        rows = compare(*reports, resamples=a.resamples, seed=a.seed)
        b.info["rows"] = rows
        say(table(rows))
        for line in doubtful_pairings(rows):
            b.log(f"warning: {line}")
        for row in rows:
            b.figure(f"{row['set']}_diff", row["diff"], verdict(row))
    if not b.ok("compare"):
        return b.finish("could not compare the two reports", a.json)
    sets = [r for r in rows if r["set"] != "overall"]
    counts = {v: sum(1 for r in sets if verdict(r) == v) for v in ("B ahead", "B behind", "undecided", "?")}
    said = ", ".join(f"{v} on {n}" for v, n in counts.items() if n)
    return b.finish(f"of {len(sets)} sets: {said}; overall B - A {rows[-1]['diff']:+.3f} ({verdict(rows[-1])})",
                    a.json)


if __name__ == "__main__":
    sys.exit(main())
