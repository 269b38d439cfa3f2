"""Loss trajectories of the golden run (tests/golden/loop_golden.py: the tiny recipe on the tiny random
Qwen3, CPU, float32) trained with Muon under each `optim.muon_iteration`, side by side. By hand only:

    python tests/golden/muon_ab.py [--steps 48] [--arms newton_schulz,gram,gram_fp16,polar_express]
    python tests/golden/muon_ab.py --steps 64 --arms newton_schulz,gram_polar4,gram_polar4_fp16
    python tests/golden/muon_ab.py --steps 64 --arms newton_schulz,gram_symmetric,gram_symmetric_fp16

`gram_fp16` (`gram_symmetric_fp16`) is the Gram form (its symmetric products, optim.muon_gram_blocks' default)
in the GPU's float16 (on a CPU `gram` runs it in float32, docs/PERF.md 3.7). `polar_express` is the standard form
with the published 5-step Polar Express schedule; `gram_polar4` the Gram form with a schedule made for 4 iterations
from 3e-3 (optim.muon_coefficients=polar_express, muon_ns_steps=4, muon_polar_lower=3e-3).
Prints every arm's losses, each arm's largest and mean |loss - newton_schulz's| and its final loss;
docs/PERF.md 3.7 holds the figures."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests.` imports

from tests.conftest import _smollm2_hf_dir, save_tiny_qwen3_dir  # noqa: E402
from tests.golden.loop_golden import TARGET_INIT_STD, golden_config  # noqa: E402

from dflash_train.train.optim import muon  # noqa: E402
from dflash_train.train.loop import train  # noqa: E402


ARMS = {  # arm (less _fp16) -> its overrides
    "newton_schulz": ("optim.muon_iteration=newton_schulz",), "gram": ("optim.muon_iteration=gram",),
    "gram_symmetric": ("optim.muon_iteration=gram_symmetric",),
    "polar_express": ("optim.muon_iteration=newton_schulz", "optim.muon_coefficients=polar_express"),
    "gram_polar4": ("optim.muon_iteration=gram", "optim.muon_coefficients=polar_express", "optim.muon_ns_steps=4",
                    "optim.muon_polar_lower=3e-3"),
}


def losses(target_dir: Path, out_dir: Path, arm: str, steps: int) -> list[float]:
    real = muon.gram_orthogonalise
    if arm.endswith("_fp16"):  # args: coefficients, safety, eps, dtype, blocks
        muon.gram_orthogonalise = lambda x, *args: real(x, *args[:3], torch.float16, *args[4:])
    try:
        train(golden_config(target_dir, out_dir, "optim.name=muon", *ARMS[arm.removesuffix("_fp16")],
                            f"train.max_steps={steps}", "train.epochs=100", "train.eval_every=1000",
                            "train.ckpt_every=1000"))
    finally:
        muon.gram_orthogonalise = real
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--arms", default="newton_schulz,gram,gram_fp16,polar_express")
    a = p.parse_args()
    arms = a.arms.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(_smollm2_hf_dir(), local_files_only=True)
        target_dir = save_tiny_qwen3_dir(Path(tmp) / "target", tokenizer, init_std=TARGET_INIT_STD)
        runs = {arm: losses(target_dir, Path(tmp) / arm, arm, a.steps) for arm in arms}
    base = runs[arms[0]]
    for arm, run in runs.items():
        gaps = [abs(x - y) for x, y in zip(run, base)]
        print(f"{arm}: losses {[round(x, 4) for x in run]}")
        print(f"{arm}: vs {arms[0]} max |diff| {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f}; "
              f"first {run[0]:.4f} last {run[-1]:.4f}; mean of the last 8 {sum(run[-8:]) / 8:.4f}")


if __name__ == "__main__":
    main()
