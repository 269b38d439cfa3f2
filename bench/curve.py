"""The `gpu` recipe's curve: real tau per domain at 3.5, 10 and 20 training minutes, data scaled to match.

    python3 bench/curve.py target.model=/tmp/smol.gguf eval.num_prompts=24 [--points 3.5,10,20] [--deadline 570]

Each point is one `dflash-train train --recipe gpu` run in its own directory, <out>/m<minutes>, with
`train.max_minutes` = the point and more prompts as it grows, the target writing more of them itself (the
default corpus holds ~9,000 and the stdlib ~3,700 code requests: the rest are synthesized): 3.5 minutes = the
recipe (15,000 prompts: 6,000 default, 3,000 code, 6,000 written by the target), 10 = 30,000 (18,000 written), 20 =
the `gpu_long` recipe (45,000: 9,000 default, 3,150 code, 32,850 written;
its cache of ~1 MB per sample must fit the disk). Points are independent and resumable: a point with its
eval report is done and skipped; one with a checkpoint continues with `--resume` (the trainer's exact resume:
the minutes already spent carry over); one without starts (its finished data caches are reused). With
`--deadline`, a point still training when the deadline nears is stopped with SIGTERM, which the trainer
answers with a checkpoint: run the same command again to go on (on the same machine: the data and checkpoints
stay in <out>). `--existing 3.5=runs/gpu` takes a run made
already as a point. A finished point's tap cache is deleted (`--keep-data` keeps it): the next point needs
the disk.

Writes <out>/curve.md (the table), curve.json and curve.png (tau per domain against minutes, and the held-out
simulated tau), prints progress every 30 s, and ends with `VERDICT curve: OK|INCOMPLETE|FAILED ...`
(exit 0, 3 when points remain to resume, 1 on a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = 9000
"""Prompts taken from the default corpus at most (it holds 9,042: docs/LOG.md, session 9); the rest are written."""
CODE_PROMPTS = 3000
"""Code requests at most (data/code_requests.py: the stdlib holds ~3,700 documented public functions on Python 3.11)."""
SAMPLES = {3.5: 15000, 10.0: 30000, 20.0: 45000}
BYTES_PER_SAMPLE = 1.1e6  # the gpu recipe's regenerate + tap cache: ~15 GB for 15,000 samples, with a margin
INTERRUPTED = 3  # the trainer's exit status when a signal stopped it after a checkpoint


@dataclass(frozen=True)
class Point:
    minutes: float
    samples: int

    @property
    def name(self) -> str:
        return f"m{self.minutes:g}"

    @property
    def mix(self) -> str:
        default = min(0.4, round(DEFAULT_PROMPTS / self.samples, 2))
        code = min(0.2, round(CODE_PROMPTS / self.samples, 2))
        return f"default:{default:g},code:{code:g},synthesize:{round(1 - default - code, 2):g}"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="overrides of every point")
    p.add_argument("--recipe", default="gpu")
    p.add_argument("--points", default="3.5,10,20", help="training minutes, comma-separated")
    p.add_argument("--samples", default="", help="M=N,...: prompts of a point (default 3.5=15000,10=30000,20=45000)")
    p.add_argument("--out", default="runs/curve")
    p.add_argument("--existing", action="append", default=[], metavar="M=DIR", help="a finished run as point M")
    p.add_argument("--deadline", type=float, default=None, help="seconds from now: stop (resumably) before them")
    p.add_argument("--stop-margin", type=float, default=60.0, help="seconds a stopped run gets to checkpoint")
    p.add_argument("--keep-data", action="store_true", help="keep a finished point's tap cache")
    p.add_argument("--table-only", action="store_true", help="only rebuild the table and plot from the points")
    return p.parse_args(argv)


def points_of(a) -> list[Point]:
    sizes = dict(SAMPLES)
    for item in filter(None, a.samples.split(",")):
        minutes, _, n = item.partition("=")
        sizes[float(minutes)] = int(n)
    points = []
    for text in a.points.split(","):
        minutes = float(text)
        if minutes not in sizes:
            raise SystemExit(f"VERDICT curve: FAILED: no data size for the {text}-minute point: add --samples {text}=N")
        points.append(Point(minutes, sizes[minutes]))
    return points


def say(line: str) -> None:
    print(f"curve: {line}", flush=True)


def point_dir(a, point: Point) -> Path:
    for item in a.existing:
        minutes, _, path = item.partition("=")
        if float(minutes) == point.minutes:
            return Path(path)
    return Path(a.out) / point.name


def command(a, point: Point, out: Path, resume: bool) -> list[str]:
    """The point's train command; a `data.train=` among the overrides replaces the point's mix."""
    mix = [] if any(o.startswith("data.train=") for o in a.overrides) else [f"data.train={point.mix}"]
    return [sys.executable, "-m", "dflash_train", "train", "--recipe", a.recipe, *a.overrides,
            f"train.out_dir={out}", f"train.max_minutes={point.minutes:g}", f"data.max_samples={point.samples}",
            *mix, *(["--resume"] if resume else [])]


def disk_problem(point: Point, out: Path) -> str | None:
    """Why the point's tap cache would not fit the free disk (None when it fits)."""
    out.mkdir(parents=True, exist_ok=True)
    need, free = point.samples * BYTES_PER_SAMPLE, shutil.disk_usage(out).free
    if list((out / "data").glob("tapped-*.safetensors")) or need < free:
        return None
    return (f"its tap cache needs ~{need / 1e9:.0f} GB, {free / 1e9:.0f} GB are free at {out}: delete finished "
            "points' caches, or give it fewer prompts (--samples)")


def run_point(a, point: Point, out: Path, ends_at: float | None) -> str:
    """Train (or resume) one point until its eval report is written; its status in a word or a sentence."""
    resume = (out / "checkpoints" / "latest").exists()
    cmd = command(a, point, out, resume)
    (out / "point.json").write_text(json.dumps({**asdict(point), "mix": point.mix, "command": cmd}, indent=1))
    say(f"{point.name}: {'resuming' if resume else 'starting'}: {' '.join(cmd)} (log {out / 'train.log'})")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = last = time.time()
    stopping = False
    with open(out / "train.log", "a") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(1.0)
            if time.time() - last >= 30:
                last = time.time()
                say(f"{point.name}: {last - t0:.0f}s; {_last_line(out / 'train.log')}")
            if ends_at is not None and time.time() > ends_at - a.stop_margin and not stopping:
                say(f"{point.name}: the deadline nears: SIGTERM (the trainer checkpoints; run again to resume)")
                proc.send_signal(signal.SIGTERM)
                stopping = True
            if ends_at is not None and time.time() > ends_at:
                proc.kill()
    rc = proc.wait()
    say(f"{point.name}: exit {rc} after {time.time() - t0:.0f}s")
    if (out / "eval" / "report.json").is_file() and rc == 0:
        return "done"
    return "interrupted" if stopping or rc == INTERRUPTED else f"failed (exit {rc}; {out / 'train.log'})"


def _last_line(path: Path) -> str:
    text = path.read_text(errors="replace")[-2000:].replace("\r", "\n")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output yet)"


def prune(out: Path) -> None:
    for cache in (out / "data").glob("tapped-*.safetensors"):
        size = cache.stat().st_size
        cache.unlink()
        say(f"deleted {cache} ({size / 1e9:.1f} GB): the point is done (--keep-data keeps it)")


def read_point(point: Point, out: Path) -> dict:
    """The point's figures: steps and held-out simulated tau (metrics.jsonl), real tau per set (its eval)."""
    row = {"minutes": point.minutes, "samples": point.samples, "mix": point.mix, "dir": str(out)}
    metrics = out / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.startswith("{")]
        steps = [r["step"] for r in records if "step" in r]
        evals = [r for r in records if "eval" in r]
        row["steps"] = max(steps) if steps else None
        row["sim_tau"] = evals[-1]["eval"]["sim_tau"] if evals else None
    report = out / "eval" / "report.json"
    if report.is_file():
        sets = json.loads(report.read_text())["sets"]
        row["tau"] = {name: figures["tau"] for name, figures in sets.items()}
    return row


def write_table(rows: list[dict], out: Path) -> list[Path]:
    sets = sorted({name for r in rows for name in r.get("tau", {})})
    head = "| minutes | prompts | steps | held-out sim tau |" + "".join(f" {name} |" for name in sets)
    lines = [head, "|" + "---|" * (4 + len(sets))]
    for r in rows:
        tau = r.get("tau", {})
        cells = [f"{r['minutes']:g}", f"{r['samples']:,}", f"{r.get('steps') or '-'}",
                 f"{r['sim_tau']:.3f}" if r.get("sim_tau") else "-", *(f"{tau[s]:.3f}" if s in tau else "-" for s in sets)]
        lines.append("| " + " | ".join(cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.md").write_text("\n".join(lines) + "\n")
    (out / "curve.json").write_text(json.dumps(rows, indent=1) + "\n")
    say("\n" + "\n".join(lines))
    return [out / "curve.md", out / "curve.json", *plot(rows, sets, out)]


def plot(rows: list[dict], sets: list[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in sets:
        xy = [(r["minutes"], r["tau"][name]) for r in rows if name in r.get("tau", {})]
        if xy:
            ax.plot(*zip(*xy), marker="o", label=name)
    sim = [(r["minutes"], r["sim_tau"]) for r in rows if r.get("sim_tau")]
    if sim:
        ax.plot(*zip(*sim), marker="s", linestyle="--", color="gray", label="held-out simulated")
    ax.set_xlabel("training minutes (one GPU; data scaled with them)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("the gpu recipe's curve")
    ax.grid(alpha=0.3)
    if sets or sim:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=120)
    plt.close(fig)
    return [out / "curve.png"]


def run_points(a, points: list[Point]) -> dict[str, str]:
    ends_at = time.time() + a.deadline if a.deadline else None
    status = {}
    for point in points:
        out = point_dir(a, point)
        if (out / "eval" / "report.json").is_file():
            status[point.name] = "done"
        elif a.table_only or (ends_at is not None and ends_at - time.time() < 2 * a.stop_margin):
            status[point.name] = "not run" if a.table_only else "interrupted"
        else:
            problem = disk_problem(point, out)
            status[point.name] = f"failed ({problem})" if problem else run_point(a, point, out, ends_at)
        if status[point.name] == "done" and not (a.keep_data or a.table_only) and out.parent == Path(a.out):
            prune(out)  # never a run given with --existing
        say(f"{point.name}: {status[point.name]}")
    return status


def main(argv=None) -> int:
    a = parse(argv)
    points = points_of(a)
    status = run_points(a, points)
    files = write_table([read_point(p, point_dir(a, p)) for p in points], Path(a.out))
    done = sum(s == "done" for s in status.values())
    failed = {n: s for n, s in status.items() if s.startswith("failed")}
    left = {n: s for n, s in status.items() if s != "done" and n not in failed}
    detail = f"{done} of {len(points)} points ({', '.join(str(f) for f in files)})"
    if failed:
        print(f"VERDICT curve: FAILED {detail}; " + "; ".join(f"{n}: {s}" for n, s in failed.items()), flush=True)
        return 1
    if left:
        print(f"VERDICT curve: INCOMPLETE {detail}; to resume, run it again: " + ", ".join(left), flush=True)
        return INTERRUPTED
    print(f"VERDICT curve: OK {detail}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
