"""Checkpoints written by a forked child beside the training (train/state/background.py): the same
checkpoint as a write in the caller, of the state as it was when `save` returned, and a failure raised
at the next `wait`, naming its cause."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from state_helpers import drafter_state

from dflash_train.model.drafter.export.hf_format import load_zlab
from dflash_train.train.state import background, checkpoint
from dflash_train.train.state.checkpoint import CheckpointWriteError, Checkpointer, DrafterState, TrainProgress, damage

pytestmark = pytest.mark.skipif(not background.supported(), reason="background writes fork: Linux only")


def _state() -> DrafterState:
    return drafter_state(moments=True)


def _progress(step: int) -> TrainProgress:
    progress = TrainProgress()
    progress.step = step
    return progress


def _read(path):
    weights = load_zlab(path / "drafter", dtype=torch.float32).state_dict()
    return weights, torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)


def test_a_background_write_is_the_checkpoint_a_write_in_the_caller_makes(tmp_path):
    state = _state()
    states = {"train": _progress(3), "optimizer": state.optimizer}
    here, beside = Checkpointer(tmp_path / "here", 2), Checkpointer(tmp_path / "beside", 2)
    here.save(3, state, states, {"note": 1}, sim_tau=2.0)
    path = beside.save(3, state, states, {"note": 1}, sim_tau=2.0, background_write=True)
    beside.wait()
    assert beside.latest() == path and beside.best() == path and beside.verified == path and not damage(path)
    (w1, t1), (w2, t2) = _read(here.latest()), _read(path)
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert t1["train"] == t2["train"] and t1["optimizer"]["param_groups"] == t2["optimizer"]["param_groups"]
    for s1, s2 in zip(t1["optimizer"]["state"].values(), t2["optimizer"]["state"].values()):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert json.loads((path / "meta.json").read_text())["note"] == 1


def test_the_state_written_is_the_one_at_save_even_as_training_changes_it(tmp_path):
    """The training goes on while the child writes: what it changes after `save` returned is not in the
    checkpoint (a write that read the live tensors later would hold a mix of two steps)."""
    state = _state()
    before = {k: v.clone() for k, v in state.drafter.state_dict().items()}
    progress = _progress(5)
    ckpt = Checkpointer(tmp_path, 2)
    path = ckpt.save(5, state, {"train": progress}, {}, background_write=True)
    with torch.no_grad():
        for p in state.drafter.parameters():
            p.add_(1.0)
    progress.step = 6
    ckpt.wait()
    weights, trainer = _read(path)
    assert all(torch.equal(weights[k], before[k]) for k in before) and trainer["train"]["step"] == 5


def test_a_failed_background_write_is_raised_at_the_next_wait_and_leaves_nothing(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, 2)
    ckpt.save(2, _state(), {"train": _progress(2)}, {})

    def full_disk(trainer, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_trainer", full_disk)  # the forked child inherits it
    ckpt.save(4, _state(), {"train": _progress(4)}, {}, background_write=True)
    with pytest.raises(CheckpointWriteError, match=r"(?s)step_00000004 not written.*No space left.*step_00000002"):
        ckpt.wait()
    assert ckpt.latest().name == "step_00000002" and not (ckpt.root / "step_00000004").exists()
    assert not list(ckpt.root.glob(".step_*"))  # no temporary left behind
    ckpt.wait()  # raised once; nothing in flight now


def test_an_error_leaving_the_training_waits_for_the_write_in_flight_and_stays_the_error_raised(tmp_path, monkeypatch):
    """The write is slowed to ~1 s: without the wait the step directory would not exist yet when the error
    arrives (the race a resume in the same process, e.g. tests/train/test_loop_golden.py, lost once in CI)."""
    real = checkpoint.save_trainer

    def slow(trainer, path):
        time.sleep(1.0)
        real(trainer, path)

    monkeypatch.setattr(checkpoint, "save_trainer", slow)  # the forked child inherits it
    ckpt, said = Checkpointer(tmp_path, 2), []
    with pytest.raises(KeyError, match="the run's own error"):
        with background.settled_on_error(ckpt.wait, said.append):
            ckpt.save(2, _state(), {"train": _progress(2)}, {}, background_write=True)
            raise KeyError("the run's own error")
    assert ckpt.latest().name == "step_00000002" and not damage(ckpt.latest()) and said == []

    def full_disk(trainer, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_trainer", full_disk)
    with pytest.raises(KeyError, match="the run's own error"):  # the write's failure is said, not raised over it
        with background.settled_on_error(ckpt.wait, said.append):
            ckpt.save(4, _state(), {"train": _progress(4)}, {}, background_write=True)
            raise KeyError("the run's own error")
    assert len(said) == 1 and "step_00000004 not written" in said[0] and "No space left" in said[0]


def test_a_long_wait_for_the_writer_is_said_with_its_pid_and_a_short_one_is_not():
    """A hung file system holds the next checkpoint (or the exit) in `wait`: said every `every` seconds."""
    slow, said = background.ForkedWrite(lambda: time.sleep(1.3), "checkpoint /x/step_00000007"), []
    assert slow.wait(say=said.append, every=0.4) is None
    assert 2 <= len(said) <= 4, said
    assert all(f"writer of checkpoint /x/step_00000007 (pid {slow.pid})" in line for line in said)
    seconds = [int(re.search(r" after (\d+) s;", line)[1]) for line in said]
    assert seconds == sorted(seconds)
    fast, quiet = background.ForkedWrite(lambda: None, "checkpoint /x/step_00000008"), []
    assert fast.wait(say=quiet.append, every=5.0) is None and quiet == []


def test_host_copy_copies_only_what_is_not_on_the_host():
    host = torch.ones(3)
    nested = {"a": [host, (host, 2)], "b": "text"}
    copied = background.host_copy(nested)
    assert copied["a"][0] is host and copied["a"][1][0] is host and copied["a"][1][1] == 2 and copied["b"] == "text"
    if torch.cuda.is_available():
        device = torch.ones(3, device="cuda")
        assert background.host_copy({"x": device})["x"].device.type == "cpu"


def test_a_write_that_fails_after_its_run_ended_is_said_at_exit(tmp_path):
    """A run that ends (an error) while a write is in flight: the interpreter's exit waits for it, and its
    failure is printed, since no later `wait` will raise it."""
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from state_helpers import drafter_state
from dflash_train.train.state import checkpoint
from dflash_train.train.state.checkpoint import Checkpointer, TrainProgress
def full_disk(trainer, path):
    raise OSError(28, "No space left on device")
checkpoint.save_trainer = full_disk
Checkpointer({str(tmp_path)!r}, 2).save(4, drafter_state(), {{"train": TrainProgress()}}, {{}}, background_write=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "checkpoint:" in done.stderr and "step_00000004 not written" in done.stderr and "No space left" in done.stderr


def test_an_exit_held_by_a_slow_writer_says_so_on_stderr(tmp_path):
    """The interpreter's exit waits for the write in flight; a long wait is said there too, not a silent stall."""
    script = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from state_helpers import drafter_state
from dflash_train.train.state import background, checkpoint
from dflash_train.train.state.checkpoint import Checkpointer, TrainProgress
real = checkpoint.save_trainer
def slow(trainer, path):
    time.sleep(1.5)
    real(trainer, path)
checkpoint.save_trainer, background.SAY_EVERY = slow, 0.4
Checkpointer({str(tmp_path)!r}, 2).save(4, drafter_state(), {{"train": TrainProgress()}}, {{}}, background_write=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "checkpoint: still waiting for the writer of checkpoint" in done.stderr and "step_00000004" in done.stderr
    assert (tmp_path / "checkpoints" / "step_00000004" / "trainer.pt").exists()
