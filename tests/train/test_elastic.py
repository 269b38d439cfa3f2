"""Elastic resume: a checkpoint taken with D drafter processes resumes with D' (2 -> 1 and 1 -> 2,
colocated <-> disaggregated) and continues the same global batches, so the losses after the
resume equal an uninterrupted D' run's (float tolerance: D and D' sum the same gradients in
another order and split them into other micro-batch groups: 3 micro-batches a rank on 2 ranks, 6 on 1).
Every job is 2 processes (2 colocated drafter ranks, or 1 target rank + 1 drafter rank): until session 23 it was
3 -> 2 and 2 -> 3 in 3 processes, ~10 s more on a 2-core box for the same re-split.

What may change: the number of drafter ranks, topology.mode, topology.target_ranks,
train.micro_batch. What may not (train/state/provenance.py refuses it by name): train.seqs_per_step,
train.seed, train.num_anchors, the data, target, tokenizer and drafter (the last four unless
train.allow_changed)."""

import os
import shutil
import subprocess

import pytest
from safetensors.torch import load_file
from test_pipeline import env, losses, train_cmd

pytestmark = pytest.mark.slow

STEPS, CKPT = 4, 2
LAYOUTS = {2: ("topology.mode=colocated",), 1: ("topology.mode=disaggregated", "topology.target_ranks=1")}


def _run(drafters, target, out, *extra):
    args = ["--recipe", "tiny", f"target.model={target}", "data.train=chitchat", "data.regenerate=false",
            "data.max_samples=60", "data.max_len=128", "train.epochs=4", f"train.max_steps={STEPS}", "train.seqs_per_step=6",
            "train.micro_batch=1", f"train.ckpt_every={CKPT}", "train.keep_last=5", "train.eval_every=100",
            "train.log_every=1", "drafter.num_taps=3", "eval.num_prompts=0", f"train.out_dir={out}",
            *LAYOUTS[drafters], *extra]
    proc = subprocess.run(train_cmd(2) + args, env=env(), timeout=500, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rewind(run: os.PathLike, to: os.PathLike) -> None:
    """A copy of `run` as it was right after its step-CKPT checkpoint (later checkpoints removed)."""
    shutil.copytree(run, to, symlinks=True)
    root = to / "checkpoints"
    for path in root.glob("step_*"):
        if int(path.name.split("_")[1]) > CKPT:
            shutil.rmtree(path)
    for link in ("latest", "best"):
        (root / link).unlink(missing_ok=True)
    (root / "latest").symlink_to(f"step_{CKPT:08d}")


def _weights(out, step: int = STEPS):
    return load_file(str(out / "checkpoints" / f"step_{step:08d}" / "drafter" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_target_dir, tmp_path_factory):
    runs = {d: tmp_path_factory.mktemp(f"d{d}") for d in LAYOUTS}
    for d, out in runs.items():
        _run(d, tiny_target_dir, out)
    return runs


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_with_another_number_of_drafter_ranks_continues_the_same_trajectory(uninterrupted, tiny_target_dir,
                                                                                 tmp_path, before, after):
    resumed = tmp_path / "resumed"
    _rewind(uninterrupted[before], resumed)
    proc = _run(after, tiny_target_dir, resumed, "train.resume=true")
    assert f"resumed from {resumed / 'checkpoints' / f'step_{CKPT:08d}'}" in proc.stdout
    assert f"the layout changed since the checkpoint (drafter_ranks: {before} -> {after}" in proc.stdout
    got, want = losses(resumed), losses(uninterrupted[after])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert len({round(v, 4) for v in want.values()}) == STEPS  # the loss moves: the comparison is not vacuous
    for step in range(CKPT + 1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), step
    final, reference, other = _weights(resumed), _weights(uninterrupted[after]), _weights(uninterrupted[before])
    start = _weights(resumed, CKPT)
    for name, tensor in reference.items():
        # D and D' ranks sum the same float32 gradients in other orders (D-PACE's confidences too), and
        # Muon's orthogonalization carries those roundings into whole rows: the two uninterrupted runs
        # measure that floor. The resumed run must sit within it, far below what the steps moved
        # (losing the optimizer state or a batch would move a weight by a whole update).
        floor = (other[name] - tensor).abs().max().item()
        moved = (tensor - start[name]).abs().max().item()
        off = (final[name] - tensor).abs().max().item()
        assert off <= 2 * floor + 1e-6, (name, off, floor)
        assert off <= 0.05 * moved + 1e-6, (name, off, moved)
