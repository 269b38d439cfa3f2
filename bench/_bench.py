"""The bench scripts' report: progress lines, failure-tolerant phases, figures and the verdict line
(`Bench`), and the device sync their timings need. Split from bench/_common.py so that bench/_health.py,
which _common re-exports, reads them without importing _common back."""

from __future__ import annotations

import contextlib
import datetime
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch


def say(line: str) -> None:
    """Print one line in a single write: print() writes the text and the newline separately, so
    under torchrun another rank's output could land between them and break a RESULT line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Bench:
    """Progress log, failure-tolerant phases, figures, JSON and the final verdict line."""

    def __init__(self, name: str, args=None, rank: int | None = None):
        self.name, self.args = name, args
        self.prefix = name if rank is None else f"{name} rank{rank}"
        self.t0 = time.perf_counter()
        self.figures: dict = {}
        self.info: dict = {}
        self.failed: list[str] = []
        self.log(f"start: {' '.join(sys.argv)}")

    def log(self, message: str) -> None:
        say(f"[{self.prefix} +{time.perf_counter() - self.t0:.0f}s] {message}")

    @contextlib.contextmanager
    def phase(self, title: str):
        """Run a block; on an exception print one clear line (and the traceback tail), record the
        failure and carry on after the block. Check `ok(title)` before using what it built."""
        self.log(f"phase '{title}': start")
        start = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
            self.failed.append(title)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.log(f"PHASE FAILED '{title}' after {time.perf_counter() - start:.1f}s: {type(e).__name__}: {first}")
            tail = traceback.format_exc().strip().splitlines()[-14:]
            say("\n".join("    | " + line for line in tail))
            if torch.cuda.is_available():
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        else:
            self.log(f"phase '{title}': done in {time.perf_counter() - start:.1f}s")

    def ok(self, *titles: str) -> bool:
        return not any(t in self.failed for t in titles)

    def figure(self, key: str, value, note: str = "") -> None:
        self.figures[key] = value
        shown = f"{value:.6g}" if isinstance(value, float) else value
        say(f"RESULT {key}={shown}" + (f"  # {note}" if note else ""))

    def finish(self, verdict: str, json_path: str | None) -> int:
        status = "OK" if not self.failed else f"PARTIAL (failed: {', '.join(self.failed)})"
        if json_path:
            payload = {"bench": self.name, "status": status, "figures": self.figures, "info": self.info,
                       "failed": self.failed, "env": environment(), "command": " ".join(sys.argv),
                       "date": datetime.date.today().isoformat()}
            try:
                Path(json_path).parent.mkdir(parents=True, exist_ok=True)
                Path(json_path).write_text(json.dumps(payload, indent=2, default=str))
                self.log(f"figures written to {json_path}")
            except OSError as e:
                self.log(f"could not write {json_path}: {e}")
        say(f"VERDICT {self.name}: {status}: {verdict}")
        return 0 if not self.failed else 1


def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
           "cpu_threads": torch.get_num_threads()}
    with contextlib.suppress(Exception):
        import transformers

        env["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        with contextlib.suppress(Exception):
            import triton

            env["triton"] = triton.__version__
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
