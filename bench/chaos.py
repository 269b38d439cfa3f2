"""Chaos trials of the 5 + 3 layout (5 target ranks feeding 3 drafter ranks) on CPU, gloo.

    python bench/chaos.py --trials 2 [--steps 12] [--seed 0] [--out runs/chaos]

One uninterrupted reference run, then per trial: start the job, wait until the drafters reach a
random step, SIGKILL or SIGTERM a random rank (target or drafter), and check that
  - the job ends (non-zero for SIGKILL) within the watchdog bound, naming the dead rank;
  - no checkpoint is half-written (every step_* holds drafter/, trainer.pt, meta.json; no temp files);
  - `train.resume=true` finishes, and the final weights equal the reference run's (float32 CPU:
    bit for bit is expected; the check allows rtol 1e-5 for another machine's kernels).
Prints `RESULT` lines and one `VERDICT chaos:` line; exits non-zero if any trial failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TARGETS, DRAFTERS = 5, 3
WATCHDOG_S = 60.0


def job(out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={TARGETS + DRAFTERS}",
            "--monitor-interval=0.5", "-m", "dflash_train", "train", "--recipe", "tiny",
            "topology.mode=disaggregated", f"topology.target_ranks={TARGETS}", "train.seqs_per_step=6",
            "data.max_samples=80", "data.regenerate=false", "train.epochs=4",
            f"train.max_steps={steps}", "train.ckpt_every=2", "train.log_every=1", "train.eval_every=1000",
            f"train.watchdog_seconds={WATCHDOG_S}", "eval.num_prompts=0", f"train.out_dir={out}", *extra]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def rank_pid(parent: int, rank: int) -> int | None:
    """The worker process of `rank` among torchrun's descendants (read from its environment)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text().split()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID" in b"".join(environ) \
                and _descends(int(stat[3]), parent):
            return int(proc.name)
    return None


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().split()[3])
        except OSError:
            return False
    return False


def checkpoint_problems(out: Path) -> list[str]:
    root = out / "checkpoints"
    problems = [f"{p}: missing {part}" for p in root.glob("step_*") for part in ("drafter", "trainer.pt", "meta.json")
                if not (p / part).exists()]
    problems += [f"left-over temporary {p}" for p in root.rglob(".*tmp*")]
    return problems


def final_weights(out: Path) -> dict:
    return load_file(str(out / "checkpoints" / "latest" / "drafter" / "model.safetensors"))


def trial(index: int, rng: random.Random, steps: int, root: Path, reference: dict) -> list[str]:
    out = root / f"trial{index}"
    rank, sig = rng.randrange(TARGETS + DRAFTERS), rng.choice([signal.SIGKILL, signal.SIGTERM])
    at_step = rng.randrange(2, steps - 1)
    print(f"trial {index}: {sig.name} to rank {rank} at step {at_step}", flush=True)
    log = open(out.with_suffix(".log"), "w")
    proc = subprocess.Popen(job(out, steps), env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while last_step(out) < at_step and proc.poll() is None:
        time.sleep(0.2)
    pid = rank_pid(proc.pid, rank)
    if pid is None:
        return [f"trial {index}: rank {rank}'s process not found (job ended: {proc.poll()})"]
    os.kill(pid, sig)
    killed_at = time.time()
    try:
        code = proc.wait(timeout=WATCHDOG_S * 2 + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return [f"trial {index}: the job did not end within {WATCHDOG_S * 2 + 60:.0f}s of the {sig.name} (a hang)"]
    log.close()
    ended_s = time.time() - killed_at
    text = out.with_suffix(".log").read_text()
    problems = checkpoint_problems(out)
    if sig == signal.SIGKILL and (code == 0 or f"rank: {rank}" not in text):
        problems.append(f"trial {index}: exit {code}; the dead rank {rank} {'is' if f'rank: {rank}' in text else 'is not'} named")
    print(f"RESULT trial{index}_ended_s={ended_s:.1f} exit={code}", flush=True)
    resumed = subprocess.run(job(out, steps, "train.resume=true"), env=env(), capture_output=True, text=True)
    if resumed.returncode != 0:
        return problems + [f"trial {index}: resume failed: {resumed.stdout[-1500:]}{resumed.stderr[-1500:]}"]
    got = final_weights(out)
    for name, tensor in reference.items():
        if not torch.allclose(got[name], tensor, rtol=1e-5, atol=1e-7):
            problems.append(f"trial {index}: {name} differs from the uninterrupted run "
                            f"(max abs {float((got[name] - tensor).abs().max()):.3g})")
    exact = all(torch.equal(got[n], t) for n, t in reference.items())
    print(f"RESULT trial{index}_bit_exact={exact}", flush=True)
    return problems + checkpoint_problems(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "chaos")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    print(f"chaos: reference run ({TARGETS}+{DRAFTERS}, {args.steps} steps)", flush=True)
    ref = subprocess.run(job(args.out / "reference", args.steps), env=env(), capture_output=True, text=True)
    if ref.returncode != 0:
        print(ref.stdout[-3000:], ref.stderr[-3000:])
        print("VERDICT chaos: FAILED (the reference run failed)")
        return 1
    reference = final_weights(args.out / "reference")
    problems = []
    for i in range(args.trials):
        problems += trial(i, rng, args.steps, args.out, reference)
    for p in problems:
        print("PROBLEM", p)
    print(f"VERDICT chaos: {'OK' if not problems else 'FAILED'} ({args.trials} trials, {len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
