"""Training checkpoints: everything needed to continue exactly, written atomically.

Every resumable thing is `Stateful` (torch.distributed.checkpoint.stateful's protocol:
`state_dict()` / `load_state_dict()`); one `Checkpointer` saves and restores them all, by name.
Layout of `<out_dir>/checkpoints/step_00000100/`:
  drafter/      the `DrafterState`: z-lab format in float32 (the master weights; vLLM/SGLang load
                it as is)
  trainer.pt    {name: state_dict()} of the others: "train" (progress), "optimizer", "scheduler",
                "data" (the taps source's cursor), "budget" (a time budget's decision), "rng"
                (torch.save of plain tensors and containers; loaded with weights_only=True)
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
import torch.distributed as dist
import transformers
from safetensors import SafetensorError
from torch.distributed.checkpoint.stateful import Stateful

from dflash_train import atomic
from dflash_train.model.hf_format import load_zlab, save_zlab
from dflash_train.train.optim import full_precision_weights


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
    return {"argv": sys.argv, "git_sha": sha, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0], "world_size": world_size}


class RNGState:
    """Stateful: the torch, python and CUDA generators of this process."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


class TrainProgress:
    """Stateful: steps taken, tokens trained on, seconds of training spent (a time budget
    carries them over)."""

    def __init__(self):
        self.step, self.tokens, self.seconds = 0, 0, 0.0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens, self.seconds = state["step"], state["tokens"], state.get("seconds", 0.0)


class DrafterState:
    """Stateful: the drafter's float32 weights, i.e. the masters of a MasterWeightAdamW (its bf16
    module weights are their rounding). Stored as a z-lab directory rather than in trainer.pt, with
    the draft vocabulary (`draft_vocab`, the ids of the training softmax) where there is one, so that
    a checkpoint's `drafter/` exports and evaluates like the run's final one."""

    def __init__(self, drafter, optimizer, draft_vocab: torch.Tensor | None = None):
        self.drafter, self.optimizer, self.draft_vocab = drafter, optimizer, draft_vocab

    def state_dict(self) -> dict:
        with full_precision_weights(self.optimizer):
            return {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        with full_precision_weights(self.optimizer):  # bf16 weights: the float32 state loads into the masters
            self.drafter.load_state_dict(state)

    def save(self, path: Path) -> None:
        with full_precision_weights(self.optimizer):
            save_zlab(self.drafter, path, dtype=torch.float32, draft_vocab=self.draft_vocab)

    def load(self, path: Path) -> None:
        loaded = load_zlab(path, device=next(self.drafter.parameters()).device, dtype=torch.float32)
        self.load_state_dict(loaded.state_dict())


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. a full disk); the previous one is untouched."""


class Checkpointer:
    """The one manager of resumable state: `save` writes the drafter and every named Stateful,
    `restore` loads them back; `resume_point` finds what to resume from."""

    def __init__(self, out_dir: str | Path, keep_last: int):
        self.root = Path(out_dir) / "checkpoints"
        self.keep_last = max(1, keep_last)

    def resume_point(self, resume: bool, topo) -> tuple[str, dict] | None:
        """(path, trainer_state) of the latest checkpoint when resuming, read on the main drafter
        rank and shared with every rank (targets need the data cursor; trainer.pt is read once)."""
        payload = [None]
        if resume and (topo.is_main or not topo.distributed):
            path = self.latest()
            if path is None:
                print(f"resume: no checkpoint under {self.root}; starting fresh", flush=True)
            else:
                payload = [(str(path), torch.load(path / "trainer.pt", map_location="cpu", weights_only=True))]
        if topo.distributed:
            dist.broadcast_object_list(payload, src=topo.drafter_ranks[0])
        return payload[0]

    @staticmethod
    def restore(point: tuple[str, dict], states: dict[str, Stateful], model: DrafterState | None = None) -> None:
        """Load a resume point into `model` and the named states (a name the checkpoint lacks,
        written by an older version, keeps its fresh state)."""
        path, trainer = point
        missing = [part for part in ("drafter", "trainer.pt", "meta.json") if not (Path(path) / part).exists()]
        if missing:
            raise FileNotFoundError(f"{path}: incomplete checkpoint, missing {missing}")
        if model is not None:
            model.load(Path(path) / "drafter")
        for name, state in states.items():
            if name in trainer:
                state.load_state_dict(trainer[name])

    def latest(self) -> Path | None:
        link = self.root / "latest"
        return link.resolve() if link.exists() else None

    def best(self) -> Path | None:
        link = self.root / "best"
        return link.resolve() if link.exists() else None

    def save(self, step: int, model: DrafterState, states: dict[str, Stateful], meta: dict,
             sim_tau: float | None = None) -> Path:
        """Write step_<step>/ atomically: the drafter and {name: state_dict()} of every Stateful;
        repoint `latest` (and `best`), prune old steps."""
        name = f"step_{step:08d}"
        self._remove_stale_temporaries()
        try:
            with atomic.atomic_dir(self.root / name) as tmp:
                model.save(tmp / "drafter")
                torch.save({key: state.state_dict() for key, state in states.items()}, tmp / "trainer.pt")
                (tmp / "meta.json").write_text(json.dumps({"step": step, "sim_tau": sim_tau, **meta}, indent=2,
                                                          default=str))
        except (OSError, RuntimeError, SafetensorError) as e:  # torch.save reports a failed write as RuntimeError
            raise CheckpointWriteError(f"checkpoint {self.root / name} not written ({e}); nothing half-written "
                                       f"was left, and {self.latest() or 'no earlier checkpoint'} is intact: free "
                                       "space and continue with --resume") from e
        atomic.point_link(self.root / "latest", name)
        if sim_tau is not None and sim_tau >= self._best_tau():  # ties: the later, more trained one
            atomic.point_link(self.root / "best", name)
        self._prune()
        return self.root / name

    def _remove_stale_temporaries(self) -> None:
        """Temporary directories of a writer that died mid-write (a SIGKILL): one process writes
        checkpoints, so any found before its own write are stale (never read: names are atomic)."""
        for tmp in sorted(self.root.glob(".step_*.tmp-*")):
            print(f"checkpoint: removing {tmp.name}, a partial write of an interrupted run", flush=True)
            shutil.rmtree(tmp, ignore_errors=True)

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
