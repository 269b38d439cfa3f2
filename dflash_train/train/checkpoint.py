"""Training checkpoints: everything needed to continue exactly, written atomically.

Layout of `<out_dir>/checkpoints/step_00000100/`:
  drafter/      z-lab format in float32 (the master weights; vLLM/SGLang load it as is)
  trainer.pt    optimizer, scheduler, data cursor, train state, RNG states (torch.save of plain
                tensors and containers; loaded with weights_only=True)
  meta.json     step, metrics, resolved config, provenance (argv, git sha, versions, world size)
`latest` and `best` (by held-out simulated tau) are symlinks beside them. Only the last
`keep_last` step directories are kept, plus the best one.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from dflash_train import atomic
from dflash_train.model.hf_format import load_zlab, save_zlab


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, _, gauss = random.getstate()
    random.setstate((version, tuple(state["python"]), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def provenance(world_size: int) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    import transformers

    return {"argv": sys.argv, "git_sha": sha, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "world_size": world_size}


class Checkpointer:
    def __init__(self, out_dir: str | Path, keep_last: int):
        self.root = Path(out_dir) / "checkpoints"
        self.keep_last = max(1, keep_last)

    def latest(self) -> Path | None:
        link = self.root / "latest"
        return link.resolve() if link.exists() else None

    def best(self) -> Path | None:
        link = self.root / "best"
        return link.resolve() if link.exists() else None

    def save(self, step: int, drafter, trainer_state: dict, meta: dict, sim_tau: float | None = None) -> Path:
        """Write step_<step>/ atomically, repoint `latest` (and `best`), prune old steps."""
        name = f"step_{step:08d}"
        with atomic.atomic_dir(self.root / name) as tmp:
            save_zlab(drafter, tmp / "drafter", dtype=torch.float32)
            torch.save(trainer_state, tmp / "trainer.pt")
            (tmp / "meta.json").write_text(json.dumps({"step": step, "sim_tau": sim_tau, **meta}, indent=2,
                                                      default=str))
        atomic.point_link(self.root / "latest", name)
        if sim_tau is not None and sim_tau >= self._best_tau():  # ties: the later, more trained one
            atomic.point_link(self.root / "best", name)
        self._prune()
        return self.root / name

    def _best_tau(self) -> float:
        best = self.best()
        if best is None:
            return float("-inf")
        tau = json.loads((best / "meta.json").read_text()).get("sim_tau")
        return float("-inf") if tau is None else float(tau)

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        protected = {self.best(), self.latest()}
        for old in steps[:-self.keep_last]:
            if old.resolve() not in protected:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load(path: str | Path, device) -> tuple:
        """(drafter in float32, trainer_state, meta) of a checkpoint directory."""
        path = Path(path)
        for part in ("drafter", "trainer.pt", "meta.json"):
            if not (path / part).exists():
                raise FileNotFoundError(f"{path}: incomplete checkpoint, missing {part}")
        drafter = load_zlab(path / "drafter", device=device, dtype=torch.float32)
        state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
        return drafter, state, json.loads((path / "meta.json").read_text())
