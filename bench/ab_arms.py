"""Same-data A/B arms of `dflash-train train` on one machine, run side by side at equal steps.

    python bench/ab_arms.py --out /tmp/ab --target /tmp/smol.gguf --recipe gpu --steps 1200 \
        --common eval.num_prompts=24 --arm base= --arm dpace=loss.weighting=dpace \
        --arm all=loss.weighting=dpace,optim.name=muon,loss.train_vocab=none

The data is built once (a one-step run of the first arm's settings without its overrides), then
hard-linked into every arm's output directory, so each arm trains on the same samples and taps
(the regenerate+tap cache, memory-mapped: one copy in the page cache). Arms then run as separate
processes (one training job each: the GPU is shared, so compare steps, not seconds) with
`train.max_steps` equal for all and `train.max_minutes=none`; each arm ends with its own real
speculative-decoding eval. A deadline kills what is left and says so. Prints one line per arm and
writes summary.json: steps, held-out simulated tau, and per prompt set real tau, speedup,
per-position acceptance and outputs identical to plain greedy. Then each arm's eval against the first
arm's, prompt by prompt (dflash_train/eval/compare.py): per set the difference, its paired 95 % interval and
a verdict, printed and written to comparisons.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.eval.compare import compare, table  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description="A/B arms of dflash-train train on shared data")
    p.add_argument("--out", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--recipe", default="gpu")
    p.add_argument("--steps", type=int, required=True, help="train.max_steps of every arm")
    p.add_argument("--common", action="append", default=[], help="overrides of every arm, comma-separated")
    p.add_argument("--arm", action="append", required=True, help="NAME=override,override,... (may be empty)")
    p.add_argument("--parallel", type=int, default=8, help="arms at once")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each arm")
    p.add_argument("--deadline", type=float, default=1e9, help="seconds from start after which arms are killed")
    return p.parse_args(argv)


def _split(items: list[str]) -> list[str]:
    return [o for item in items for o in item.split(",") if o]


def _command(a, out_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_train", "train", "--recipe", a.recipe, f"target.model={a.target}",
            f"train.out_dir={out_dir}", "train.max_minutes=none", "train.tensorboard=false",
            "train.ckpt_every=100000", *_split(a.common), *overrides]


def build_data(a, out: Path, env: dict) -> None:
    """One step of the recipe without any arm's overrides: the shared regenerate+tap cache."""
    log = out / "data_build.log"
    cmd = _command(a, out / "data_build", ["train.max_steps=1", "eval.num_prompts=0"])
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    print(f"ab: data built in {time.time() - t0:.0f} s (rc {rc}, {log})", flush=True)
    if rc != 0:
        raise SystemExit(f"ab: FAILED: the data build failed (rc {rc}); see {log}")


def launch(a, out: Path, name: str, overrides: list[str], env: dict) -> subprocess.Popen:
    arm_dir = out / name
    if not (arm_dir / "data").exists():
        shutil.copytree(out / "data_build" / "data", arm_dir / "data", copy_function=os.link)
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen(_command(a, arm_dir, [f"train.max_steps={a.steps}", *overrides]), stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.started = time.time()
    print(f"ab: {name} started ({' '.join(overrides) or 'recipe as is'})", flush=True)
    return proc


def summary_of(out: Path, name: str, rc, seconds: float) -> dict:
    arm_dir, row = out / name, {"arm": name, "rc": rc, "seconds": round(seconds, 1)}
    metrics = arm_dir / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        evals = [r for r in records if "eval" in r]
        steps = [r["step"] for r in records if "step" in r]
        row["steps"] = max(steps) if steps else 0
        if evals:
            row["held_out_sim_tau"] = evals[-1]["eval"]["sim_tau"]
            row["held_out_curve"] = [(r["step"], round(r["eval"]["sim_tau"], 4)) for r in evals]
    report = arm_dir / "eval" / "report.json"
    if report.exists():
        sets = json.loads(report.read_text())["sets"]
        row["sets"] = {k: {f: v.get(f) for f in ("tau", "speedup", "per_position_acceptance", "identical_outputs",
                                                  "num_prompts", "sim_tau", "cycle_plain_steps")}
                       for k, v in sets.items()}
    return row


def against_first(out: Path, names: list[str]) -> list[dict]:
    """Each arm's eval report against the first arm's, prompt by prompt; arms without a report are left out."""
    base = out / names[0] / "eval" / "report.json"
    if not base.exists():
        return []
    first, rows = json.loads(base.read_text()), []
    for name in names[1:]:
        report = out / name / "eval" / "report.json"
        if report.exists():
            rows.append({"arm": name, "against": names[0], "sets": compare(first, json.loads(report.read_text()))})
            print(f"ab: {name} against {names[0]}:\n{table(rows[-1]['sets'])}", flush=True)
    return rows


def main(argv=None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
    arms = [(spec.split("=", 1)[0], _split([spec.split("=", 1)[1]]) if "=" in spec else []) for spec in a.arm]
    if not (out / "data_build" / "data").exists():
        build_data(a, out, env)
    pending, running, rows = list(arms), {}, []
    while pending or running:
        while pending and len(running) < a.parallel:
            name, overrides = pending.pop(0)
            running[name] = launch(a, out, name, overrides, env)
        time.sleep(5)
        for name, proc in list(running.items()):
            late = time.time() - t0 > a.deadline
            if proc.poll() is None and late:
                os.killpg(proc.pid, 9)
                print(f"ab: {name} killed at the deadline ({a.deadline:.0f} s)", flush=True)
            if proc.poll() is not None or late:
                rows.append(summary_of(out, name, proc.poll(), time.time() - proc.started))
                print("ab: " + json.dumps(rows[-1]), flush=True)
                del running[name]
        (out / "summary.json").write_text(json.dumps(rows, indent=1))
    (out / "comparisons.json").write_text(json.dumps(against_first(out, [name for name, _ in arms]), indent=1))
    failed = [r["arm"] for r in rows if r["rc"] != 0]
    print(f"ab: {'OK' if not failed else 'FAILED: ' + ', '.join(failed)} ({len(rows)} arms, "
          f"{time.time() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
