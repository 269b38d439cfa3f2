"""Chaos trials of the 5 + 3 layout (5 target ranks feeding 3 drafter ranks) on CPU, gloo.

    python bench/chaos.py --trials 2 [--steps 12] [--seed 0] [--out runs/chaos] [--targets 5 --drafters 3]

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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
WATCHDOG_S = 60.0


@dataclass(frozen=True)
class Layout:
    """Target ranks feeding drafter ranks, and the job's length."""

    targets: int = 5
    drafters: int = 3
    steps: int = 12

    @property
    def world(self) -> int:
        return self.targets + self.drafters


def job(out: Path, layout: Layout, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.world}",
            "--monitor-interval=0.5", "-m", "dflash_train", "train", "--recipe", "tiny",
            "topology.mode=disaggregated", f"topology.target_ranks={layout.targets}",
            f"train.seqs_per_step={2 * layout.drafters}", "data.train=chitchat", "data.max_samples=80",
            "data.regenerate=false", "train.epochs=4", f"train.max_steps={layout.steps}", "train.ckpt_every=2", "train.log_every=1",
            "train.eval_every=1000", f"train.watchdog_seconds={WATCHDOG_S}", "eval.num_prompts=0",
            f"train.out_dir={out}", *extra]


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


def checkpoint_problems(out: Path, temporaries: bool = True) -> list[str]:
    """Checkpoints missing a part; with `temporaries`, temporary directories left over. Right after a
    SIGKILL a writer's temporary may remain (never read: names are atomic); the next write of the
    resumed run must remove it, so the check after the resume includes them."""
    root = out / "checkpoints"
    problems = [f"{p}: missing {part}" for p in root.glob("step_*") for part in ("drafter", "trainer.pt", "meta.json")
                if not (p / part).exists()]
    if temporaries:
        problems += [f"left-over temporary {p}" for p in root.rglob(".*tmp*")]
    return problems


def final_weights(out: Path) -> dict:
    return load_file(str(out / "checkpoints" / "latest" / "drafter" / "model.safetensors"))


class TrialAborted(Exception):
    """The trial could not go on (the rank's process was not found, or the job hung)."""


def trial(index: int, rng: random.Random, layout: Layout, root: Path, reference: dict) -> list[str]:
    """One random fault: a random rank, SIGKILL or SIGTERM, at a random step."""
    rank, sig = rng.randrange(layout.world), rng.choice([signal.SIGKILL, signal.SIGTERM])
    return fault_and_resume(f"trial {index}", root / f"trial{index}", layout, rank, sig,
                            rng.randrange(2, layout.steps - 1), reference)


def fault_and_resume(name: str, out: Path, layout: Layout, rank: int, sig: signal.Signals, at_step: int,
                     reference: dict) -> list[str]:
    """Start the job, send `sig` to `rank` once the drafters reach `at_step`, check how it ended
    and what it left on disk, resume it, and compare the final weights with `reference`."""
    print(f"{name}: {sig.name} to rank {rank} at step {at_step}", flush=True)
    try:
        problems = kill_at(name, out, layout, rank, sig, at_step)
    except TrialAborted as e:
        return [str(e)]
    resumed = subprocess.run(job(out, layout, "train.resume=true"), env=env(), capture_output=True, text=True)
    if resumed.returncode != 0:
        return problems + [f"{name}: resume failed: {resumed.stdout[-1500:]}{resumed.stderr[-1500:]}"]
    got = final_weights(out)
    for key, tensor in reference.items():
        if not torch.allclose(got[key], tensor, rtol=1e-5, atol=1e-7):
            problems.append(f"{name}: {key} differs from the uninterrupted run "
                            f"(max abs {float((got[key] - tensor).abs().max()):.3g})")
    exact = all(torch.equal(got[k], t) for k, t in reference.items())
    print(f"RESULT {name.replace(' ', '')}_bit_exact={exact}", flush=True)
    return problems + checkpoint_problems(out)


def kill_at(name: str, out: Path, layout: Layout, rank: int, sig: signal.Signals, at_step: int) -> list[str]:
    """Run the job until `at_step`, signal `rank`; problems: a hang, an unnamed dead rank, a
    zero exit after SIGKILL, a half-written checkpoint."""
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(job(out, layout), env=env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while last_step(out) < at_step and proc.poll() is None:
            time.sleep(0.2)
        pid = rank_pid(proc.pid, rank)
        if pid is None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TrialAborted(f"{name}: rank {rank}'s process not found (job ended: {proc.poll()})")
        os.kill(pid, sig)
        killed_at = time.time()
        try:
            code = proc.wait(timeout=WATCHDOG_S * 2 + 60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TrialAborted(f"{name}: the job did not end within {WATCHDOG_S * 2 + 60:.0f}s of the {sig.name} "
                               "(a hang)")
    text = out.with_suffix(".log").read_text()
    problems = checkpoint_problems(out, temporaries=False)
    left = checkpoint_problems(out)[len(problems):]
    if left:
        print(f"{name}: after the kill: {', '.join(left)} (to be removed by the resumed run)", flush=True)
    named = f"rank: {rank}" in text
    if sig == signal.SIGKILL and (code == 0 or not named):
        problems.append(f"{name}: exit {code}; the dead rank {rank} {'is' if named else 'is not'} named")
    print(f"RESULT {name.replace(' ', '')}_ended_s={time.time() - killed_at:.1f} exit={code}", flush=True)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "chaos")
    parser.add_argument("--targets", type=int, default=5)
    parser.add_argument("--drafters", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    layout = Layout(args.targets, args.drafters, args.steps)
    print(f"chaos: reference run ({layout.targets}+{layout.drafters}, {layout.steps} steps)", flush=True)
    ref = subprocess.run(job(args.out / "reference", layout), env=env(), capture_output=True, text=True)
    if ref.returncode != 0:
        print(ref.stdout[-3000:], ref.stderr[-3000:])
        print("VERDICT chaos: FAILED (the reference run failed)")
        return 1
    reference = final_weights(args.out / "reference")
    problems, start = [], time.time()
    for i in range(args.trials):
        problems += trial(i, rng, layout, args.out, reference)
        done = i + 1
        eta = (time.time() - start) / done * (args.trials - done)
        print(f"chaos: {done}/{args.trials} trials, {len(problems)} problems, ETA {eta / 60:.1f} min", flush=True)
    for p in problems:
        print("PROBLEM", p)
    print(f"VERDICT chaos: {'OK' if not problems else 'FAILED'} ({args.trials} trials, {len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
