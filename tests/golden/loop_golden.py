"""The golden training run: one small real configuration of `train(cfg)`, what is read back from
the files it writes, and the comparison with the stored trajectory (`train_loop.json`).

Shared by tests/train/test_loop_golden.py (compares) and tests/golden/regenerate.py (rewrites the
golden file, by hand only). Only the public surface is used: `recipes`, `apply_overrides`,
`train(cfg)`, `metrics.jsonl` and the returned summary, so the loop's internals may change freely.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dflash_train import recipes
from dflash_train.config import RunConfig
from dflash_train.overrides import apply_overrides

GOLDEN_FILE = Path(__file__).with_name("train_loop.json")
STEPS = 16
CKPT_EVERY = 6
# float32 on CPU. Measured on a 2-core box (2026-12-01): two runs, and runs with 1 and 2 torch
# threads, gave bit-identical losses, grad norms and held-out tau; the tolerance leaves room for
# another CPU's kernels, and is far below what a changed step moves (see test_loop_golden.py).
RTOL = 1e-5
ATOL = 1e-7

# The target: the tests' tiny random Qwen3 (tests/conftest.py tiny_qwen3) with initializer_range
# 0.2 instead of 0.02, so its tied lm_head is not nearly flat and the loss follows the drafter's
# training (9.65 -> ~8.2 here; with 0.02 it stays within 0.06 of ln 4096 and a +1% lr left every
# loss within 1e-5).
TARGET_INIT_STD = 0.2
# The tiny recipe on that target and real chitchat conversations (not regenerated: the target
# computes the taps every step, the colocated path), at a full initial logit scale and lr 2e-2 so
# the loss moves in 16 steps (step 1 is clipped: grad norm ~5 > 1). 4 sequences per step in
# micro-batches of 2 (gradient accumulation 2); ~13 steps per epoch, so 16 steps cross an epoch
# boundary and the sampler's reshuffle; held-out simulated tau at steps 8 and 16; checkpoints every
# 6 steps (the resume test). The decay weighting the file was recorded with (the default became D-PACE
# in session 13; decay keeps the trajectory of sessions 1-12 checkable, D-PACE is checked against a
# naive loop in tests/train/loss/test_loss.py).
OVERRIDES = (
    "drafter.init_norm_scale=1.0", "optim.lr=0.02", "loss.weighting=decay",
    "target.dtype=float32", "data.train=chitchat", "data.regenerate=false", "data.max_samples=96",
    "data.max_len=128", "train.epochs=4", f"train.max_steps={STEPS}", "train.seqs_per_step=4",
    "train.micro_batch=2", "train.log_every=1", "train.eval_every=8", f"train.ckpt_every={CKPT_EVERY}",
    "train.keep_last=5", "train.compile=off", "train.attention=sdpa", "train.tensorboard=false",
    "eval.num_prompts=0", "drafter.num_taps=3",
)
TRAIN_KEYS = ("epoch", "loss", "acc", "sim_tau", "eal", "grad_norm", "lr")
EVAL_KEYS = ("sim_tau", "acc")


def golden_config(target_dir: Path, out_dir: Path, *extra: str) -> RunConfig:
    return apply_overrides(recipes.get("tiny"),
                           [f"target.model={target_dir}", *OVERRIDES, f"train.out_dir={out_dir}", *extra])


def trajectory(out_dir: Path, result: dict) -> dict:
    """What the golden file keeps: per step the logged training figures, per evaluated step the
    held-out figures, and the run's totals (wall-clock figures left out)."""
    train, held_out = {}, {}
    for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            train[str(record["step"])] = {k: record[k] for k in TRAIN_KEYS}
        elif "eval" in record:
            held_out[str(record["step"])] = {k: record["eval"][k] for k in EVAL_KEYS}
    return {"train": train, "held_out": held_out, "steps": result["steps"], "tokens": result["tokens"]}


def differences(got, want, path: str = "") -> list[str]:
    """Every leaf where `got` and `want` differ (floats at RTOL/ATOL, all else exactly)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{path or '/'}: keys {sorted(got)} != golden {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}/{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{path}: length {len(got)} != golden {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]")]
    if isinstance(want, float) or isinstance(got, float):
        if math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL):
            return []
        return [f"{path}: {got!r} != golden {want!r} (rel diff {abs(got - want) / max(abs(want), 1e-30):.2e})"]
    return [] if got == want else [f"{path}: {got!r} != golden {want!r}"]


def load_golden() -> dict:
    return json.loads(GOLDEN_FILE.read_text())
