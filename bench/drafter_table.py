"""Issue 37's drafter-step table in one call: each arm is one `bench/drafter_step.py` process (its own
compile, its own peak memory) with the shared flags, optionally an older tree's script beside it on
the arms it knows, run alternately; a markdown table of tok/s, s/step, peak GiB and MFU at the end.

    python3 bench/drafter_table.py --out $OUT/table --arms dflash,dspark_kl,dspark_tv \
        --old /tmp/old59 -- --steps 20 --warmup 3 --no-attn-ratio --precision fp8 --fp8-lm-head --chunk-tokens 4096

`--old DIR`: a tree with its own bench/drafter_step.py (`git archive 59a2ec5 | tar -x -C DIR`); it
runs the arms marked `old` (the flags it has). Every arm's log and JSON land in --out. Exit status 1
when an arm failed; the verdict line names it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DSPARK = ["--arch", "dspark", "--block-size", "8"]
ARMS = {  # name: (extra flags, runs on the old tree too)
    "dflash": ([], True),
    "dspark_kl": (DSPARK + ["--loss", "kl"], False),
    "dspark_tv": (DSPARK + ["--loss", "tv"], False),
    "dspark_kl_muon": (DSPARK + ["--loss", "kl", "--optim", "muon"], False),  # the default iteration (gram)
    "dspark_kl_muon_ns": (DSPARK + ["--loss", "kl", "--optim", "muon", "--muon-iteration", "newton_schulz"], False),
    "dspark_kl_mb8": (DSPARK + ["--loss", "kl", "--micro-batches", "8"], False),
    "dspark_kl_muon_mb8": (DSPARK + ["--loss", "kl", "--optim", "muon", "--micro-batches", "8"], False),
    "dspark_kl_muon_ns_mb8": (DSPARK + ["--loss", "kl", "--optim", "muon", "--muon-iteration", "newton_schulz",
                                        "--micro-batches", "8"], False),
    "dspark_kl_muon_sym": (DSPARK + ["--loss", "kl", "--optim", "muon", "--muon-iteration", "gram_symmetric"], False),
    "dspark_kl_muon_sym8": (DSPARK + ["--loss", "kl", "--optim", "muon", "--muon-iteration", "gram_symmetric",
                                      "--muon-gram-blocks", "8"], False),
    "dspark_kl_muon_sym_mb8": (DSPARK + ["--loss", "kl", "--optim", "muon", "--muon-iteration", "gram_symmetric",
                                         "--micro-batches", "8"], False),
    "dspark_kl_muon_sym8_mb8": (DSPARK + ["--loss", "kl", "--optim", "muon", "--muon-iteration", "gram_symmetric",
                                          "--muon-gram-blocks", "8", "--micro-batches", "8"], False),
    "gpu_recipe": (DSPARK + ["--loss", "tv", "--weighting", "dpace", "--optim", "muon"], False),
}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default="dflash,dspark_kl,dspark_tv",
                   help=f"comma-separated arms, in order (known: {', '.join(ARMS)})")
    p.add_argument("--old", help="an older tree whose bench/drafter_step.py runs beside on the arms it knows")
    p.add_argument("--repeat", type=int, default=1, help="runs of each arm (alternating trees), default 1")
    p.add_argument("--out", required=True, help="folder for each run's log and JSON")
    p.add_argument("--timeout", type=int, default=420, help="seconds per run (default 420)")
    p.add_argument("shared", nargs=argparse.REMAINDER, help="-- then the flags every run gets")
    a = p.parse_args(argv)
    a.shared = [x for x in a.shared if x != "--"]
    unknown = [arm for arm in a.arms.split(",") if arm not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    return a


def run_one(tree: Path, label: str, flags: list[str], out: Path, timeout: int) -> dict:
    """One drafter_step.py process; its figures (empty on a failure) and status."""
    json_path, log_path = out / f"{label}.json", out / f"{label}.log"
    cmd = [sys.executable, str(tree / "bench" / "drafter_step.py"), *flags, "--json", str(json_path)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    figures = json.loads(json_path.read_text())["figures"] if json_path.is_file() else {}
    print(f"[drafter_table] {label}: exit {code} in {time.perf_counter() - start:.0f}s, "
          f"{figures.get('tokens_per_s', float('nan')):.0f} tok/s (log {log_path})", flush=True)
    return {"label": label, "code": code, "figures": figures}


def row(result: dict) -> str:
    f = result["figures"]
    cells = [f"{f['tokens_per_s']:,.0f}" if "tokens_per_s" in f else "-",
             f"{f['step_time_median_s']:.4f}" if "step_time_median_s" in f else "-",
             f"{f['peak_memory_gib']:.2f}" if "peak_memory_gib" in f else "-",
             f"{f['mfu']:.1%}" if "mfu" in f else "-", f"{f['mfu_arch']:.1%}" if "mfu_arch" in f else "-"]
    return f"| {result['label']} | " + " | ".join(cells) + f" | {result['code']} |"


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parents[1]
    results = []
    for arm in a.arms.split(","):
        flags, on_old = ARMS[arm]
        for i in range(a.repeat):
            results.append(run_one(here, f"{arm}-new-{i}", a.shared + flags, out, a.timeout))
            if a.old and on_old:
                results.append(run_one(Path(a.old), f"{arm}-old-{i}", a.shared + flags, out, a.timeout))
    print("| run | tok/s | s/step | peak GiB | MFU (DFlash FLOPs) | MFU (arch FLOPs) | exit |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        print(row(result))
    (out / "table.json").write_text(json.dumps(results, indent=2))
    failed = [r["label"] for r in results if r["code"] != 0]
    print(f"VERDICT drafter_table: {'OK' if not failed else 'FAILED: ' + ', '.join(failed)}: {len(results)} runs",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
