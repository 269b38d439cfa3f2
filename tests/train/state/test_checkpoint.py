"""Checkpointer housekeeping: a temporary directory that a killed writer left behind (found by
bench/chaos.py: SIGKILL of the main drafter rank during a checkpoint write) is removed at the next
write, and never taken for a checkpoint."""

import pytest
import torch
from state_helpers import drafter_state

from dflash_train.train.state.checkpoint import (CheckpointDamaged, Checkpointer, DrafterState, NonFiniteWeights,
                                                 TrainProgress)
from dflash_train.train.parallel.topology import Topology


def _state() -> DrafterState:
    return drafter_state()


def test_a_killed_writers_temporary_directory_is_removed_at_the_next_write(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, keep_last=3)
    ckpt.save(2, _state(), {"train": TrainProgress()}, {})
    stale = ckpt.root / ".step_00000004.tmp-k1lled"  # what atomic_dir leaves when its process dies
    (stale / "drafter").mkdir(parents=True)
    (stale / "trainer.pt").write_bytes(b"half")
    assert ckpt.latest().name == "step_00000002"  # never read as a checkpoint
    ckpt.save(4, _state(), {"train": TrainProgress()}, {})
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert "removing .step_00000004.tmp-k1lled" in capsys.readouterr().out
    assert torch.load(ckpt.latest() / "trainer.pt", weights_only=True)["train"]["step"] == 0


# --- verified checkpoints (issue 32, defect 2) ----------------------------------------------------

WORLD_OF_ONE = Topology("colocated", world_size=1, rank=0, local_rank=0, num_target_ranks=0)


def _progress(step: int) -> TrainProgress:
    progress = TrainProgress()
    progress.step = step
    return progress


def _saved(tmp_path, steps=(2, 4), keep_last=5) -> Checkpointer:
    ckpt = Checkpointer(tmp_path, keep_last=keep_last)
    for step in steps:
        ckpt.save(step, _state(), {"train": _progress(step)}, {})
    return ckpt


def _overwrite_middle(path, n=4096) -> None:
    """n bytes of 0xFF in the middle of `path`, size unchanged (the user's corruption)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * min(n, size // 2))


def test_a_corrupt_latest_is_named_and_the_newest_intact_checkpoint_is_taken(tmp_path, capsys):
    ckpt = _saved(tmp_path)
    _overwrite_middle(ckpt.root / "step_00000004" / "drafter" / "model.safetensors")
    point = ckpt.resume_point(True, WORLD_OF_ONE)
    assert point.path.name == "step_00000002" and point.trainer["train"]["step"] == 2
    out = capsys.readouterr().out
    assert "step_00000004" in out and "drafter/model.safetensors" in out and "checksum" in out
    assert "resuming from step_00000002" in out
    assert ckpt.latest().name == "step_00000002"  # the damaged one is set aside, never taken again
    assert not (ckpt.root / "step_00000004").exists() and any(ckpt.root.glob("damaged/step_00000004*"))


@pytest.mark.parametrize("part", ["trainer.pt", "drafter/model.safetensors", "meta.json"])
def test_a_truncated_file_is_named_with_the_checkpoint_to_resume_from(tmp_path, capsys, part):
    ckpt = _saved(tmp_path)
    path = ckpt.root / "step_00000004" / part
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    point = ckpt.resume_point(True, WORLD_OF_ONE)
    assert point.path.name == "step_00000002"
    out = capsys.readouterr().out
    assert f"step_00000004/{part}" in out or ("step_00000004" in out and part in out)


def test_resume_accepts_a_checkpoint_path_and_refuses_a_damaged_one_offering_an_intact_one(tmp_path):
    ckpt = _saved(tmp_path)
    point = ckpt.resume_point(str(ckpt.root / "step_00000002"), WORLD_OF_ONE)
    assert point.path.name == "step_00000002" and point.trainer["train"]["step"] == 2
    _overwrite_middle(ckpt.root / "step_00000002" / "trainer.pt")
    with pytest.raises(CheckpointDamaged, match=r"(?s)step_00000002.*trainer.pt.*train.resume=.*step_00000004"):
        ckpt.resume_point(str(ckpt.root / "step_00000002"), WORLD_OF_ONE)


def test_non_finite_weights_are_never_written(tmp_path):
    ckpt = _saved(tmp_path, steps=(2,))
    state = DrafterState(_state().drafter, None)  # no master copies: the weights are what is stored
    with torch.no_grad():
        next(state.drafter.parameters()).view(-1)[3] = float("nan")
    with pytest.raises(NonFiniteWeights, match="non-finite"):
        ckpt.save(4, state, {"train": _progress(4)}, {}, sim_tau=9.0)
    assert ckpt.latest().name == "step_00000002" and not (ckpt.root / "step_00000004").exists()
    assert ckpt.best() is None or ckpt.best().name == "step_00000002"


def test_no_checkpoint_at_all_starts_fresh_and_all_damaged_says_so(tmp_path, capsys):
    assert Checkpointer(tmp_path / "none", keep_last=2).resume_point(True, WORLD_OF_ONE) is None
    ckpt = _saved(tmp_path, steps=(2,))
    _overwrite_middle(ckpt.root / "step_00000002" / "trainer.pt")
    assert ckpt.resume_point(True, WORLD_OF_ONE) is None
    assert "no intact checkpoint" in capsys.readouterr().out


def test_resume_past_a_corrupt_latest_ends_with_the_uninterrupted_weights(tiny_qwen3_dir, tmp_path, contained,
                                                                           capsys):
    """The user's case: 4 KiB of 0xFF in latest's drafter weights, then --resume. The damaged
    checkpoint is named and set aside, the run resumes from the one before, and ends on the
    uninterrupted run's weights; nothing non-finite is ever written, ranked best or exported."""
    import shutil

    from golden.loop_golden import golden_config
    from safetensors.torch import load_file

    from dflash_train.train.loop import train

    def cfg(out, *extra):
        return golden_config(tiny_qwen3_dir, out, "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=2",
                             "train.keep_last=2", *extra)

    reference, run = tmp_path / "reference", tmp_path / "run"
    train(cfg(reference))
    shutil.copytree(reference, run, symlinks=True)
    _overwrite_middle(run / "checkpoints" / "step_00000004" / "drafter" / "model.safetensors")
    capsys.readouterr()
    result = train(cfg(run, "train.resume=true"))
    out = capsys.readouterr().out
    assert "step_00000004" in out and "drafter/model.safetensors" in out and "resuming from step_00000002" in out
    assert result["steps"] == 4
    want = load_file(str(reference / "checkpoints" / "step_00000004" / "drafter" / "model.safetensors"))
    for path in (run / "checkpoints").glob("step_*/drafter/model.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(str(path)).values()), path
    got = load_file(str(run / "checkpoints" / "step_00000004" / "drafter" / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    exported = load_file(str(run / "drafter" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in exported.values())


# --- links that do not lead to an intact checkpoint of this run (issue 39, defects 1 and 6) -------


def test_a_dangling_latest_resumes_from_the_newest_intact_checkpoint_and_keeps_it(tmp_path, capsys):
    """`latest` names a step directory that is gone (deleted, or lost with a node): the newest intact
    checkpoint is taken and said, and the next save prunes nothing the run resumed from."""
    ckpt = _saved(tmp_path, steps=(2, 4), keep_last=2)
    import os

    os.replace(ckpt.root / "step_00000004", tmp_path / "elsewhere")  # latest now dangles
    point = ckpt.resume_point(True, WORLD_OF_ONE)
    assert point is not None and point.path.name == "step_00000002"
    out = capsys.readouterr().out
    assert "latest" in out and "step_00000004" in out and "missing" in out and "starting fresh" not in out
    ckpt.save(3, _state(), {"train": _progress(3)}, {})
    ckpt.save(4, _state(), {"train": _progress(4)}, {})
    assert sorted(p.name for p in ckpt.root.glob("step_*")) == ["step_00000003", "step_00000004"]


@pytest.mark.parametrize("absolute", [True, False])
def test_a_latest_pointing_outside_the_run_is_never_followed_nor_moved(tmp_path, capsys, absolute):
    """`latest` (and `best`) pointing at a directory outside checkpoints/: not read, not moved into
    damaged/, not pruned; the newest intact checkpoint of the run is taken and the link named."""
    import os

    precious = tmp_path / "users" / "precious"
    precious.mkdir(parents=True)
    (precious / "thesis.txt").write_text("mine")
    ckpt = _saved(tmp_path / "run", steps=(2, 4))
    for link in ("latest", "best"):
        (ckpt.root / link).unlink(missing_ok=True)
        os.symlink(precious if absolute else os.path.relpath(precious, ckpt.root), ckpt.root / link)
    point = ckpt.resume_point(True, WORLD_OF_ONE)
    assert point.path.name == "step_00000004"
    out = capsys.readouterr().out
    assert "outside" in out and str(precious) in out
    assert (precious / "thesis.txt").read_text() == "mine" and not (ckpt.root / "damaged").exists()
    assert ckpt.intact_best(print).name == "step_00000004"
    ckpt.save(6, _state(), {"train": _progress(6)}, {}, sim_tau=1.0)
    assert (precious / "thesis.txt").read_text() == "mine"


def test_a_step_directory_that_is_a_link_out_of_the_run_is_never_read_moved_or_pruned(tmp_path, capsys):
    import os

    precious = tmp_path / "users" / "precious"
    precious.mkdir(parents=True)
    (precious / "thesis.txt").write_text("mine")
    ckpt = _saved(tmp_path / "run", steps=(2,), keep_last=1)
    os.symlink(precious, ckpt.root / "step_00000009")
    (ckpt.root / "latest").unlink()  # the run's checkpoints found by their names alone
    point = ckpt.resume_point(True, WORLD_OF_ONE)
    assert point.path.name == "step_00000002"
    for step in (3, 4, 5):
        ckpt.save(step, _state(), {"train": _progress(step)}, {})
    assert (precious / "thesis.txt").read_text() == "mine" and (ckpt.root / "step_00000009").is_symlink()


def test_every_checkpoint_damaged_starts_fresh_with_a_warning_not_a_plain_ok(tmp_path, capsys):
    ckpt = _saved(tmp_path, steps=(2, 4))
    for step in (2, 4):
        _overwrite_middle(ckpt.root / f"step_0000000{step}" / "trainer.pt")
    assert ckpt.resume_point(True, WORLD_OF_ONE) is None
    assert len(ckpt.warnings) == 1 and "step_00000002" in ckpt.warnings[0] and "step_00000004" in ckpt.warnings[0]
    assert "damaged" in ckpt.warnings[0] and "started fresh" in ckpt.warnings[0]


def test_a_trainer_file_that_is_not_a_tensor_pickle_is_named_and_never_loaded_unsafely(tmp_path, capsys):
    """Issue 39: a checkpoint whose trainer.pt is some other pickle (or garbage), with no records to
    catch it (an older version's meta.json), gave a traceback advising weights_only=False."""
    import datetime
    import json
    import pickle

    ckpt = _saved(tmp_path, steps=(2, 4))
    step4 = ckpt.root / "step_00000004"
    meta = json.loads((step4 / "meta.json").read_text())
    meta.pop("files")  # as an older version wrote it
    (step4 / "meta.json").write_text(json.dumps(meta))
    (step4 / "trainer.pt").write_bytes(pickle.dumps({"train": datetime.datetime(2026, 1, 1)}))
    with pytest.raises(CheckpointDamaged) as refused:
        ckpt.resume_point(str(step4), WORLD_OF_ONE)
    assert "trainer.pt is not a checkpoint this trainer wrote" in str(refused.value)
    assert "weights_only set to False" not in str(refused.value)
    point = ckpt.resume_point(True, WORLD_OF_ONE)
    out = capsys.readouterr().out
    assert point.path.name == "step_00000002" and "trainer.pt is not a checkpoint" in out
    (ckpt.root / "step_00000002" / "trainer.pt").write_bytes(b"hello world")  # garbage, and no record either
    meta2 = json.loads((ckpt.root / "step_00000002" / "meta.json").read_text())
    meta2.pop("files")
    (ckpt.root / "step_00000002" / "meta.json").write_text(json.dumps(meta2))
    assert ckpt.resume_point(True, WORLD_OF_ONE) is None and "not a checkpoint" in capsys.readouterr().out


def test_resume_with_every_checkpoint_damaged_ends_with_a_warning_verdict(tiny_qwen3_dir, tmp_path, contained, capsys):
    """Issue 39: both checkpoints damaged ended "starting fresh" with a plain OK verdict."""
    from golden.loop_golden import OVERRIDES

    from dflash_train import cli

    run = tmp_path / "run"
    argv = ["train", "--recipe", "tiny", f"target.model={tiny_qwen3_dir}", *OVERRIDES, f"train.out_dir={run}",
            "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=2", "train.keep_last=2"]
    assert cli.main(argv) == 0
    for step in (2, 4):
        _overwrite_middle(run / "checkpoints" / f"step_0000000{step}" / "trainer.pt")
    capsys.readouterr()
    assert cli.main(argv + ["--resume"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("dflash-train train: WARNING started fresh: every checkpoint under")
    assert "step_00000004, step_00000002" in last and "damaged" in last
