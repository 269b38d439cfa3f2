"""Chaos trials of a disaggregated layout (default 5 target ranks feeding 3 drafter ranks) on CPU, gloo.

    python bench/chaos.py --trials 20 [--targets 5 --drafters 3] [--steps 12] [--seed 0] [--out runs/chaos]

One uninterrupted reference run, then per trial (`Fault`): start the job, wait until the drafters
reach a random step, send SIGTERM or SIGKILL to one process of a random kind (the torchrun launcher,
the main drafter rank, another drafter rank, a target rank; the first trials cover every pair),
optionally damage a file of the latest checkpoint (4 KiB of 0xFF in its middle, or cut to a
third), optionally resume with one drafter rank fewer or more, and check that
  - the job ends within ENDED_WITHIN_S of the fault, every worker process gone, with the right
    verdict: SIGTERM anywhere, or SIGKILL of the launcher: one `INTERRUPTED after step S` line
    naming the cause, and `latest` is step S, the last step trained (nothing lost); SIGKILL of a
    rank: a FAILED line of another rank naming it, and nothing lost beyond the last periodic
    checkpoint;
  - no checkpoint is half-written (every step_* holds drafter/, trainer.pt, meta.json);
  - a damaged latest is named at resume and the newest intact checkpoint is taken;
  - `train.resume=true` finishes, and the final weights equal the reference run's: float32 CPU,
    checked at rtol 1e-5, atol 1e-6 with the same drafter ranks (bit for bit with 1 or 2 drafter
    ranks; with 3, last-ulp differences in the gradient all-reduce appear some steps after a
    resume and grow to ~3e-7 over 10 steps: docs/LOG.md), and at rtol 1e-4, atol 1e-6 with
    another number of drafter ranks (the gradients are summed in another order).
Prints `RESULT` lines and one `VERDICT chaos:` line; exits non-zero if any trial failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
WATCHDOG_S = 60.0
ENDED_WITHIN_S = 30.0
CKPT_EVERY = 2
WHO = ("launcher", "main", "drafter", "target")
DAMAGE = ("", "corrupt", "truncate")
PARTS = ("drafter/model.safetensors", "trainer.pt", "meta.json")
SAME_RTOL, SAME_ATOL, ELASTIC_RTOL, ELASTIC_ATOL = 1e-5, 1e-6, 1e-4, 1e-6


@dataclass(frozen=True)
class Layout:
    """Target ranks feeding drafter ranks, the job's length and target; `seqs` fixes the global
    batch (a resume with another number of drafter ranks keeps it)."""

    targets: int = 5
    drafters: int = 3
    steps: int = 12
    target: str = "smollm2"
    seqs: int | None = None
    extra: tuple[str, ...] = ()  # more overrides (a tiny test target's drafter.num_taps)

    @property
    def world(self) -> int:
        return self.targets + self.drafters

    @property
    def seqs_per_step(self) -> int:
        return self.seqs or 2 * self.drafters


@dataclass(frozen=True)
class Fault:
    """What a trial does: `sig` to a process of kind `who` once the drafters reach `at_step`;
    then `damage` ("", corrupt or truncate) to `part` of the latest checkpoint, and the resume with
    `resume_drafters` drafter ranks (None: as before)."""

    sig: signal.Signals
    who: str
    at_step: int
    damage: str = ""
    part: str = PARTS[0]
    resume_drafters: int | None = None

    def describe(self) -> str:
        extra = f"; then {self.damage} {self.part}" if self.damage else ""
        extra += f"; resume with {self.resume_drafters} drafter ranks" if self.resume_drafters else ""
        return f"{self.sig.name} to the {self.who} at step {self.at_step}{extra}"


def job(out: Path, layout: Layout, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.world}",
            "--monitor-interval=0.5", "-m", "dflash_train", "train", "--recipe", "tiny", f"target.model={layout.target}",
            "topology.mode=disaggregated", f"topology.target_ranks={layout.targets}",
            f"train.seqs_per_step={layout.seqs_per_step}", "data.train=chitchat", "data.max_samples=80",
            "data.regenerate=false", "train.epochs=4", f"train.max_steps={layout.steps}",
            f"train.ckpt_every={CKPT_EVERY}", "train.log_every=1", "train.eval_every=1000",
            f"train.watchdog_seconds={WATCHDOG_S}", "eval.num_prompts=0", f"train.out_dir={out}", *layout.extra, *extra]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=0)


def latest_step(out: Path) -> int:
    link = out / "checkpoints" / "latest"
    return int(link.resolve().name.split("_")[1]) if link.exists() else 0


def workers(parent: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (read from their environment)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
            ppid = int((proc / "stat").read_text().split()[3])
        except (OSError, ValueError):
            continue
        if b"TORCHELASTIC_RUN_ID" in environ and b"RANK" in environ and _descends(ppid, parent):
            found[int(environ[b"RANK"])] = int(proc.name)
    return found


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().split()[3])
        except OSError:
            return False
    return False


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def rank_of(who: str, layout: Layout, rng: random.Random) -> int | None:
    """The rank a fault of kind `who` hits (None: the launcher)."""
    if who == "launcher":
        return None
    if who == "main":
        return layout.targets
    if who == "drafter":
        return rng.randrange(layout.targets + 1, layout.world)
    return rng.randrange(layout.targets)


def checkpoint_problems(out: Path, temporaries: bool = True) -> list[str]:
    """Checkpoints missing a part; with `temporaries`, temporary directories left over. Right after a
    SIGKILL a writer's temporary may remain (never read: names are atomic); the next write of the
    resumed run must remove it, so the check after the resume includes them."""
    root = out / "checkpoints"
    problems = [f"{p}: missing {part}" for p in root.glob("step_*") for part in ("drafter", "trainer.pt", "meta.json")
                if not (p / part).exists()]
    if temporaries:
        problems += [f"left-over temporary {p}" for p in root.glob(".*tmp*")]
    return problems


def final_weights(out: Path) -> dict:
    return load_file(str(out / "checkpoints" / "latest" / "drafter" / "model.safetensors"))


def damage(out: Path, fault: Fault) -> str:
    """Damage `fault.part` of the latest checkpoint; returns its step directory's name."""
    latest = (out / "checkpoints" / "latest").resolve()
    path = latest / fault.part
    size = path.stat().st_size
    if fault.damage == "corrupt":
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\xff" * min(4096, size // 2))
    else:
        path.write_bytes(path.read_bytes()[: size // 3])
    return latest.name


class TrialAborted(Exception):
    """The trial could not go on (the rank's process was not found, or the job hung)."""


def trial(index: int, rng: random.Random, layout: Layout, root: Path, reference: dict, cover: list) -> list[str]:
    """One fault: the first trials walk `cover` (every signal and process kind), later ones draw."""
    sig, who = cover[index] if index < len(cover) else (rng.choice([signal.SIGTERM, signal.SIGKILL]), rng.choice(WHO))
    divisors = [d for d in range(1, layout.seqs_per_step + 1)
                if layout.seqs_per_step % d == 0 and d != layout.drafters and abs(d - layout.drafters) == 1]
    fault = Fault(sig, who, rng.randrange(2, layout.steps - 1), DAMAGE[index % len(DAMAGE)], rng.choice(PARTS),
                  rng.choice(divisors) if index % 4 == 3 and divisors else None)
    return fault_and_resume(f"trial {index}", root / f"trial{index}", layout, fault, reference, rng)


def fault_and_resume(name: str, out: Path, layout: Layout, fault: Fault, reference: dict,
                     rng: random.Random | None = None) -> list[str]:
    """Run the fault, check how the job ended and what it left on disk, damage the latest
    checkpoint if asked, resume it, and compare the final weights with `reference`."""
    print(f"{name}: {fault.describe()}", flush=True)
    try:
        problems = kill_at(name, out, layout, fault, rng)
    except TrialAborted as e:
        return [str(e)]
    damaged = damage(out, fault) if fault.damage and latest_step(out) else None
    resumed_layout = replace(layout, drafters=fault.resume_drafters or layout.drafters, seqs=layout.seqs_per_step)
    resumed = subprocess.run(job(out, resumed_layout, "train.resume=true"), env=env(), capture_output=True, text=True)
    if resumed.returncode != 0:
        return problems + [f"{name}: resume failed: {resumed.stdout[-1500:]}{resumed.stderr[-1500:]}"]
    if damaged and not re.search(rf"checkpoint \S*{damaged} is damaged: .*{re.escape(fault.part)}", resumed.stdout):
        problems.append(f"{name}: the damaged {damaged}/{fault.part} was not named at resume")
    got = final_weights(out)
    rtol, atol = (ELASTIC_RTOL, ELASTIC_ATOL) if fault.resume_drafters else (SAME_RTOL, SAME_ATOL)
    worst = max(float((got[k] - t).abs().max()) for k, t in reference.items())
    for key, tensor in reference.items():
        if not torch.allclose(got[key], tensor, rtol=rtol, atol=atol):
            problems.append(f"{name}: {key} differs from the uninterrupted run "
                            f"(max abs {float((got[key] - tensor).abs().max()):.3g}; rtol {rtol})")
    exact = all(torch.equal(got[k], t) for k, t in reference.items())
    tag = name.replace(" ", "")
    print(f"RESULT {tag}_bit_exact={exact} max_abs_diff={worst:.3g}", flush=True)
    return problems + checkpoint_problems(out)


def kill_at(name: str, out: Path, layout: Layout, fault: Fault, rng: random.Random | None = None) -> list[str]:
    """Run the job until `fault.at_step`, send the signal, wait for every process to end; the
    problems with how it ended (see the module doc)."""
    rank = rank_of(fault.who, layout, rng or random.Random(0))
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(job(out, layout), env=env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while last_step(out) < fault.at_step and proc.poll() is None:
            time.sleep(0.2)
        ranks = workers(proc.pid)
        pid = proc.pid if rank is None else ranks.get(rank)
        if pid is None or proc.poll() is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TrialAborted(f"{name}: rank {rank}'s process not found (job ended: {proc.poll()})")
        os.kill(pid, fault.sig)
        killed_at = time.time()
        code = _wait_all(proc, ranks.values(), killed_at, name)
    ended = time.time() - killed_at
    text = out.with_suffix(".log").read_text()
    problems = checkpoint_problems(out, temporaries=False)
    problems += _verdict_problems(name, text, fault, rank, code, layout)
    lost = last_step(out) - latest_step(out)
    if fault.sig == signal.SIGTERM or fault.who == "launcher":
        if lost:
            problems.append(f"{name}: {lost} steps trained after the last checkpoint (step {latest_step(out)})")
    elif lost > CKPT_EVERY:
        problems.append(f"{name}: {lost} steps lost, more than since the last periodic checkpoint")
    if ended > ENDED_WITHIN_S:
        problems.append(f"{name}: the job ended {ended:.0f} s after the fault (more than {ENDED_WITHIN_S:.0f} s)")
    print(f"RESULT {name.replace(' ', '')}_ended_s={ended:.1f} exit={code} lost_steps={lost} "
          f"latest={latest_step(out)}", flush=True)
    print(f"RESULT {name.replace(' ', '')}_lost_steps={lost}", flush=True)
    return problems


def _wait_all(proc: subprocess.Popen, pids, since: float, name: str) -> int | None:
    """Wait for the launcher and every worker (a SIGKILLed launcher leaves its workers running)."""
    limit = since + WATCHDOG_S * 2 + 60
    while time.time() < limit:
        code = proc.poll()
        if code is not None and not any(_alive(p) for p in pids):
            return code
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TrialAborted(f"{name}: the job did not end within {limit - since:.0f}s of the fault (a hang)")


def _verdict_problems(name: str, text: str, fault: Fault, rank: int | None, code, layout: Layout) -> list[str]:
    interrupted = re.findall(r"dflash-train train: INTERRUPTED after step (\d+) of \d+ \((.*?)\): checkpoint", text)
    if fault.sig == signal.SIGTERM or fault.who == "launcher":
        if len(interrupted) != 1:
            return [f"{name}: {len(interrupted)} INTERRUPTED verdicts, expected one"]
        cause = interrupted[0][1]
        # torchrun forwards a SIGTERM to every rank; a rank blocked in a wait may read it after its last vote
        want = ("the launcher died" if fault.sig == signal.SIGKILL else
                "SIGTERM on " if fault.who == "launcher" else f"SIGTERM on rank {rank} (")
        return [] if want in cause else [f"{name}: the verdict's cause {cause!r} does not name {want!r}"]
    named = re.search(rf"FAILED on rank \d+: rank {rank} \(", text)
    problems = [] if named else [f"{name}: no other rank names the dead rank {rank}"]
    return problems + ([f"{name}: exit 0 after SIGKILL"] if code == 0 else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "chaos")
    parser.add_argument("--targets", type=int, default=5)
    parser.add_argument("--drafters", type=int, default=3)
    parser.add_argument("--target", default="smollm2")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    layout = Layout(args.targets, args.drafters, args.steps, args.target)
    print(f"chaos: reference run ({layout.targets}+{layout.drafters}, {layout.steps} steps)", flush=True)
    ref = subprocess.run(job(args.out / "reference", layout), env=env(), capture_output=True, text=True)
    if ref.returncode != 0:
        print(ref.stdout[-3000:], ref.stderr[-3000:])
        print("VERDICT chaos: FAILED (the reference run failed)")
        return 1
    reference = final_weights(args.out / "reference")
    cover = list(itertools.product([signal.SIGTERM, signal.SIGKILL], WHO))
    rng.shuffle(cover)
    problems, start = [], time.time()
    for i in range(args.trials):
        problems += trial(i, rng, layout, args.out, reference, cover)
        done = i + 1
        eta = (time.time() - start) / done * (args.trials - done)
        print(f"chaos: {done}/{args.trials} trials, {len(problems)} problems, ETA {eta / 60:.1f} min", flush=True)
    for p in problems:
        print("PROBLEM", p)
    print(f"VERDICT chaos: {'OK' if not problems else 'FAILED'} ({args.trials} trials, {len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
