"""Training checkpoints: everything needed to continue exactly, written atomically.

Every resumable thing is `Stateful` (torch.distributed.checkpoint.stateful's protocol:
`state_dict()` / `load_state_dict()`); one `Checkpointer` saves and restores them all, by name.
Layout of `<out_dir>/checkpoints/step_00000100/`:
  drafter/      the `DrafterState`: z-lab format in float32 (the master weights; vLLM/SGLang load
                it as is)
  trainer.pt    {name: state_dict()} of the others: "train" (progress), "optimizer", "scheduler",
                "data" (the taps source's cursor), "budget" (a time budget's decision), "rng"
                (torch.save of plain tensors and containers; loaded with weights_only=True)
  meta.json     step, metrics, resolved config, provenance (argv, git sha, versions, world size), and
                `files`: each other file's size and sha256, recorded when written (meta.json last)
`latest` and `best` (by held-out simulated tau) are symlinks beside them. Only the last
`keep_last` step directories are kept, plus the best one and the newest verified one.

Verified: before anything of a checkpoint is loaded, every file is checked against its recorded
size and sha256 (`damage`). Resuming (`train.resume=true`) takes the newest intact checkpoint:
a damaged `latest` is named, moved to `checkpoints/damaged/`, and the one before is taken with a
line saying so (every one damaged: the run starts fresh and its verdict says so, `warnings`);
`train.resume=PATH` takes that checkpoint or refuses it, naming the newest intact one. `latest`
and `best` are followed only to a step directory of this run (`_link`): a link that dangles or
leads elsewhere is named and the newest intact checkpoint taken, so nothing outside `checkpoints/`
is ever read, moved or pruned. A trainer.pt is only ever loaded with weights_only=True. Non-finite
weights are never written (`NonFiniteWeights`), so never ranked best or exported. During training a
forked child writes each checkpoint beside the loop (`background.py`); the final one is written in it.
Only the main drafter rank reads a checkpoint; the others receive it (`resume_point`), so no other
node needs to see `train.out_dir`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from safetensors import SafetensorError
from torch.distributed.checkpoint.stateful import Stateful

from dflash_train import atomic
from dflash_train.model.drafter.export.draft_vocab import load_draft_vocab
from dflash_train.model.drafter.export.hf_format import (NonFiniteWeights, is_export, load_zlab, non_finite_weights,
                                                         write_dir, zlab_files)
from dflash_train.model.drafter.export.export import export_drafter
from dflash_train.train.optim.optimizer import full_precision_weights
from dflash_train.train.state import background


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
        self.snapshot()(path)

    def snapshot(self):
        """A writer `(path) -> None` of the drafter's directory from a host copy of its float32 weights taken now
        (on the CPU, the weights themselves: a forked writer sees them as they were at the fork)."""
        with full_precision_weights(self.optimizer):
            files = zlab_files(self.drafter, torch.float32, None, None, self.draft_vocab, None)
        return lambda path: write_dir(path, files)

    def load(self, path: Path) -> None:
        loaded = load_zlab(path, device=next(self.drafter.parameters()).device, dtype=torch.float32)
        self.load_state_dict(loaded.state_dict())

    def non_finite(self) -> str | None:
        """The first weight holding a NaN or an infinity, or None."""
        with full_precision_weights(self.optimizer):
            return first_non_finite(self.drafter.state_dict())


def first_non_finite(tensors: dict) -> str | None:
    bad = non_finite_weights(tensors)
    return bad[0] if bad else None


def _load_trainer(path: Path) -> dict:
    """trainer.pt as written by `save_trainer` (plain tensors and containers, weights_only=True). A file
    torch's safe loader refuses is not one of ours: a ValueError naming it. It is never loaded with
    weights_only=False, which torch's own message suggests and which would run any code in it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, KeyError, AttributeError, TypeError, IndexError, ImportError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path.name} is not a checkpoint this trainer wrote (torch.load with weights_only=True "
                         f"refused it: {type(e).__name__}: {first[:160]}); it is not loaded any other way, since "
                         "that could run code in it") from None


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. a full disk); the previous one is untouched."""

    readable = True  # cli.py: the message alone, no traceback


class CheckpointDamaged(ValueError):
    """`train.resume=PATH` names a checkpoint whose files do not match their recorded checksums."""


@dataclass
class ResumePoint:
    """A verified checkpoint as read by the main drafter rank and shared with every rank."""

    path: Path
    trainer: dict  # {name: state_dict()} of trainer.pt
    weights: dict  # the drafter's float32 state dict


FILES = "files"  # meta.json's record of every other file: {relative path: {"size", "sha256"}}
PARTS = ("drafter", "trainer.pt", "meta.json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(root: Path) -> dict:
    """{relative path: {"size", "sha256"}} of every file under `root` but meta.json."""
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "meta.json"}


def damage(path: Path) -> list[str]:
    """What is wrong with the checkpoint at `path` (empty: intact): missing parts, an unreadable
    meta.json, files whose size or sha256 differ from those recorded when it was written. A
    checkpoint of an older version, without records, is checked for its parts only."""
    path = Path(path)
    problems = [f"{part} missing" for part in PARTS if not (path / part).exists()]
    if problems:
        return problems
    try:
        records = json.loads((path / "meta.json").read_text()).get(FILES, {})
    except (OSError, ValueError, AttributeError) as e:
        return [f"meta.json unreadable ({type(e).__name__})"]
    for name, want in records.items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} missing")
        elif file.stat().st_size != want["size"]:
            problems.append(f"{name} is {file.stat().st_size} bytes, {want['size']} when written (truncated?)")
        elif _sha256(file) != want["sha256"]:
            problems.append(f"{name} does not match its checksum (sha256) recorded when written (corrupted)")
    return problems


class _RecordingWriter(io.RawIOBase):
    """A file for torch.save that keeps the OSError of a failed write: torch reports only its own
    `unexpected pos`, which names neither the file nor the cause (e.g. a full disk)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise


def save_trainer(trainer: dict, path: Path) -> None:
    """trainer.pt: {name: state_dict()} of the Stateful parts, as `Checkpointer.save` took them."""
    with open(path, "wb") as f:
        writer = _RecordingWriter(f)
        try:
            torch.save(trainer, writer)
        except RuntimeError as e:
            raise (writer.error or e) from None


class Checkpointer:
    """The one manager of resumable state: `save` writes the drafter and every named Stateful,
    `restore` loads them back; `resume_point` finds what to resume from."""

    def __init__(self, out_dir: str | Path, keep_last: int):
        self.root = Path(out_dir).absolute() / "checkpoints"
        self.keep_last = max(1, keep_last)
        self.verified: Path | None = None  # the newest checkpoint known intact (written or checked here)
        self.warnings: list[str] = []  # what the run's verdict must say (every checkpoint damaged: started fresh)
        self._pending: tuple[background.ForkedWrite, Path] | None = None  # a write in flight, and where

    def resume_point(self, resume: bool | str, topo, group=None, log=print) -> ResumePoint | None:
        """The verified checkpoint to resume from (see the module doc), read on the main drafter
        rank only and shared with every rank over `group` (targets need the data cursor; other
        nodes need not see this directory)."""
        payload = [None]
        if resume and (topo.is_main or not topo.distributed):
            payload = [self._find(resume, log)]
        if topo.distributed:
            dist.broadcast_object_list(payload, src=topo.drafter_ranks[0], group=group)
        return payload[0]

    def _find(self, resume: bool | str, log) -> ResumePoint | None:
        if isinstance(resume, str):
            return self._explicit(Path(resume).expanduser(), log)
        latest, why = self._link("latest")
        if why:
            log(f"resume: {self.root / 'latest'} {why}; taking the newest intact checkpoint of this run")
        candidates = ([latest] if latest else []) + [p for p in self._steps()[::-1] if p != latest]
        if not candidates:
            log(f"resume: no checkpoint under {self.root}; starting fresh")
            return None
        damaged = []
        for candidate in candidates:
            point, problems = self._read(candidate)
            if point is not None:
                if candidate != latest:
                    log(f"resume: resuming from {candidate.name}, the newest intact checkpoint (its later steps "
                        "are trained again)")
                    atomic.point_link(self.root / "latest", candidate.name)
                return point
            damaged.append(candidate.name)
            log(f"resume: checkpoint {candidate} is damaged: {'; '.join(problems)}; moved to "
                f"{self._set_aside(candidate)}")
        self.warnings.append(f"started fresh: every checkpoint under {self.root} was damaged ({', '.join(damaged)}; "
                             f"kept in {self.root / 'damaged'})")
        log(f"resume: no intact checkpoint under {self.root}; starting fresh")
        return None

    def _explicit(self, path: Path, log) -> ResumePoint:
        point, problems = self._read(path.resolve())
        if point is None:
            intact = next((p for p in self._steps()[::-1] if not damage(p)), None)
            offer = f"the newest intact one is {intact}: train.resume={intact}" if intact else "no intact one"
            raise CheckpointDamaged(f"train.resume={path}: {'; '.join(problems)}; {offer}")
        log(f"resume: from {point.path} (train.resume)")
        return point

    def _read(self, path: Path) -> tuple[ResumePoint | None, list[str]]:
        """(the verified checkpoint, []) or (None, what is wrong with it)."""
        if not path.is_dir():
            return None, [f"{path} is not a checkpoint directory"]
        problems = damage(path)
        if problems:
            return None, [f"{path.name}/{p}" for p in problems]
        try:
            trainer = _load_trainer(path / "trainer.pt")
            weights = load_zlab(path / "drafter", device="cpu", dtype=torch.float32).state_dict()
        except (OSError, RuntimeError, ValueError, SafetensorError, EOFError) as e:  # a checkpoint without records
            return None, [f"{path.name} unreadable: {type(e).__name__}: {str(e).splitlines()[0]}"]
        bad = first_non_finite(weights)
        if bad is not None:
            return None, [f"{path.name}/drafter holds non-finite weights ({bad}; written before this check)"]
        self.verified = path
        return ResumePoint(path, trainer, weights), []

    def _set_aside(self, path: Path) -> Path:
        """A damaged checkpoint of this run out of the way (kept for inspection, never taken or counted
        again); only a real step directory inside `root` is ever moved (`_steps`, `_link`)."""
        if path.is_symlink() or path.parent.resolve() != self.root.resolve():
            raise ValueError(f"{path} is not a checkpoint directory of {self.root}: not moved")
        dest = self.root / "damaged" / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        path.rename(dest)
        for link in ("latest", "best"):
            if (self.root / link).is_symlink() and not (self.root / link).exists():
                (self.root / link).unlink()  # it pointed at the damaged one
        return dest

    @staticmethod
    def restore(point: ResumePoint, states: dict[str, Stateful], model: DrafterState | None = None) -> None:
        """Load a resume point into `model` and the named states (a name the checkpoint lacks,
        written by an older version, keeps its fresh state)."""
        if model is not None:
            model.load_state_dict(point.weights)
        for name, state in states.items():
            if name in point.trainer:
                state.load_state_dict(point.trainer[name])

    def latest(self) -> Path | None:
        return self._link("latest")[0]

    def best(self) -> Path | None:
        return self._link("best")[0]

    def _link(self, name: str) -> tuple[Path | None, str]:
        """(the step directory of this run that link `name` points to, "") or (None, why not): a link
        that dangles or leads out of `root` (an absolute or `..` target, or through a linked step
        directory) is never followed, so nothing outside the run is read, moved or pruned."""
        link = self.root / name
        if not link.is_symlink():
            return None, ""
        target = Path(os.path.normpath(link.parent / os.readlink(link)))
        inside = target.parent.resolve() == self.root.resolve() and target.name.startswith("step_")
        if not inside or target.is_symlink():
            return None, f"points to {target}, outside {self.root}: not followed"
        if not target.is_dir():
            return None, f"points to {target.name}, which is missing"
        return self.root / target.name, ""

    def intact_best(self, log=print) -> Path | None:
        """What to export: `best` if intact, else the newest intact checkpoint (said)."""
        best = self.best() or self.latest()
        if best is not None and not damage(best):
            return best
        intact = next((p for p in self._steps()[::-1] if not damage(p)), None)
        log(f"export: {best} is damaged ({'; '.join(damage(best)) if best else 'none'}); exporting {intact}")
        return intact

    def save(self, step: int, model: DrafterState, states: dict[str, Stateful], meta: dict,
             sim_tau: float | None = None, background_write: bool = False) -> Path:
        """Write step_<step>/ atomically: the drafter, {name: state_dict()} of every Stateful and the
        checksums of both; repoint `latest` (and `best`), prune old steps. With `background_write`, the
        state is taken now and written by a forked child while training goes on (`background.py`); its
        failure is raised by the next `save` or `wait`."""
        name = f"step_{step:08d}"
        bad = model.non_finite()
        if bad is not None:
            raise NonFiniteWeights(f"step {step}: the drafter's weight {bad} is non-finite: checkpoint {name} not "
                                   f"written; {self.latest() or 'no earlier checkpoint'} holds the last finite weights")
        self.wait()
        self._remove_stale_temporaries()
        write_drafter = model.snapshot()
        trainer = {key: background.host_copy(state.state_dict()) for key, state in states.items()}

        def write() -> None:
            self._write(name, write_drafter, trainer, {"step": step, "sim_tau": sim_tau, **meta}, sim_tau)

        if background_write and background.supported():
            try:
                self._pending = background.ForkedWrite(write, f"checkpoint {self.root / name}"), self.root / name
                return self.root / name
            except OSError:  # no fork (e.g. no memory for the page tables): written here instead
                pass
        write()
        return self.root / name

    def wait(self) -> None:
        """The background write in flight, if any, to its end; its failure raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error = pending[0].wait()
        if error is not None:
            raise CheckpointWriteError(error)
        self.verified = pending[1]

    def _write(self, name: str, write_drafter, trainer: dict, record: dict, sim_tau: float | None) -> None:
        try:
            with atomic.atomic_dir(self.root / name, replaceable=self._is_step_dir) as tmp:
                write_drafter(tmp / "drafter")
                save_trainer(trainer, tmp / "trainer.pt")
                record = {**record, FILES: file_records(tmp)}
                (tmp / "meta.json").write_text(json.dumps(record, indent=2, default=str))
        except (OSError, RuntimeError, SafetensorError) as e:  # torch.save reports a failed write as RuntimeError
            raise CheckpointWriteError(f"checkpoint {self.root / name} not written ({e}); nothing half-written "
                                       f"was left, and {self.latest() or 'no earlier checkpoint'} is intact: free "
                                       "space and continue with --resume") from e
        self.verified = self.root / name
        atomic.point_link(self.root / "latest", name)
        if sim_tau is not None and sim_tau >= self._best_tau():  # ties: the later, more trained one
            atomic.point_link(self.root / "best", name)
        self._prune()

    def _is_step_dir(self, path: Path) -> bool:
        """A step directory of this run (retraining a step after an earlier resume writes it again)."""
        return path.parent == self.root and path.name.startswith("step_") and not path.is_symlink()

    def _steps(self) -> list[Path]:
        """This run's step directories (a link named like one, possibly leading elsewhere, is not)."""
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.is_symlink())

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
        try:
            tau = json.loads((best / "meta.json").read_text()).get("sim_tau")
        except (OSError, ValueError):
            return float("-inf")  # a damaged best never outranks a new checkpoint
        return float("-inf") if tau is None else float(tau)

    def _prune(self) -> None:
        """Keep the last `keep_last`, best, latest, and the newest verified checkpoint."""
        protected = {self.best(), self.latest(), self.verified}
        for old in self._steps()[:-self.keep_last]:
            if old not in protected:
                shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(checkpoint: Path, out_dir: Path, log, target_cfg, training_input: dict | None = None) -> Path:
    """The serving artefact: the chosen checkpoint's drafter in bf16, z-lab format, checked, with the
    checkpoint's draft vocabulary (the ids of its training softmax, `loss.train_vocab`) if it has one.
    Non-finite weights are refused (`NonFiniteWeights`)."""
    drafter = load_zlab(checkpoint / "drafter", device="cpu")  # weights only: no optimizer state read
    bad = first_non_finite(drafter.state_dict())
    if bad is not None:
        raise NonFiniteWeights(f"{checkpoint}: the drafter's weight {bad} is non-finite: not exported")
    _keep_an_unmarked_export(out_dir / "drafter", log)
    path = export_drafter(drafter, out_dir / "drafter", target_cfg.model, target_cfg.gguf_file, log=log,
                          draft_vocab=load_draft_vocab(checkpoint / "drafter", drafter.config.vocab_size),
                          training_input=training_input)
    log(f"exported z-lab drafter {path} (from {checkpoint.name})")
    return path


def _keep_an_unmarked_export(path: Path, log) -> None:
    """The run's drafter/ written by an older version (no export marker): renamed beside it, inside the
    run directory, so the new export can take its place; nothing is deleted."""
    if path.is_dir() and not path.is_symlink() and any(path.iterdir()) and not is_export(path):
        kept = path.with_name(f"{path.name}.before-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(kept)
        log(f"export: {path} has no export marker (written by an older version, or by hand): kept as {kept}")
