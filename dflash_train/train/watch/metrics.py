"""Human and machine logs of a run: a progress bar, a JSONL metrics file, TensorBoard.

Only the main drafter rank logs. Records are appended to `metrics.jsonl`; a resumed run first
drops the records past the checkpoint it resumes from, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm


class MetricsLog:
    def __init__(self, out_dir: str | Path, total_steps: int, start_step: int, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.writer = None
        self.bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        if tensorboard:
            # optional dependency (the tensorboard package), imported only when asked for
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"), purge_step=start_step + 1)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        mininterval=1.0, smoothing=0.1)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and _step_of(line) is not None and _step_of(line) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in _scalars(record):
                self.writer.add_scalar(key, value, record["step"])

    def advance(self, n: int, postfix: dict | None = None) -> None:
        """Move the bar n steps; a postfix (loss, accuracy, rate) replaces the shown one and stays
        until the next, so the bar keeps showing the latest logged figures between log steps."""
        if self.bar is not None:
            self.bar.update(n)
            if postfix is not None:
                self.bar.set_postfix(postfix, refresh=False)

    def set_total(self, steps: int) -> None:
        """The run's step count changed (a time budget's decision): the bar's total and ETA follow."""
        if self.bar is not None:
            self.bar.total = steps
            self.bar.refresh()

    def write(self, line: str) -> None:
        """Print above the bar (flushed) so messages and the bar do not tangle."""
        if self.enabled:
            tqdm.write(line)

    def above_bar(self, log):
        """A logger for messages that come while the bar is shown (compile health): on the rank that
        shows the bar they print above it, not into its line; elsewhere `log` prints them."""
        if self.bar is None:
            return log
        return lambda message: tqdm.write(str(message))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _step_of(line: str):
    try:
        return json.loads(line).get("step")
    except json.JSONDecodeError:
        return None  # a torn last line from a killed run


def _scalars(record: dict, prefix: str = ""):
    for key, value in record.items():
        if key == "step":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, (int, float)):
            yield name, value
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (int, float)):
                    yield f"{name}/{i + 1}", v
        elif isinstance(value, dict):
            yield from _scalars(value, prefix=f"{name}/")


class TokenInterval:
    """Tokens trained since the last logged step, and when that interval began (the logged tok/s)."""

    def __init__(self):
        self.tokens, self.start = 0, time.perf_counter()

    def add(self, progress, tokens: int) -> None:
        progress.tokens += tokens
        self.tokens += tokens

    def rate(self, device: torch.device) -> float:
        """Tokens per second over the interval, which ends when its GPU work does; then a new one."""
        if device.type == "cuda":  # the record syncs anyway
            torch.cuda.synchronize(device)
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.tokens, self.start = 0, time.perf_counter()
        return rate


def fmt_values(values) -> str:
    return "[" + " ".join(f"{v:.2f}" for v in values) + "]"
