"""A training checkpoint's cost to the training loop: `Checkpointer.save` written in the caller against
written by a forked child beside it (`train/state/background.py`), at the `gpu` recipe's drafter shapes.

    python bench/checkpoint_write.py            # SmolLM2's width, 6 layers, Muon + AdamW, 5 rounds
    python bench/checkpoint_write.py --small    # 1 layer, 2 rounds (seconds)

Per round, interleaved: the caller's write (the seconds `save` holds the loop), then the background one
(the seconds `save` holds the loop, and those until its child is done), each on a fresh Checkpointer in a
temporary directory. Then what the child costs a loop that runs beside it: a pure-Python loop's rate over
the first 0.25 s of the background write against its rate alone (on a machine with a core to spare for the
child, ~1; on a 2-core box the two share the cores). Figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from bench import _common as C  # noqa: E402
from dflash_train import recipes  # noqa: E402
from dflash_train.model.drafter.backbone import DFlashDrafter  # noqa: E402
from dflash_train.model.drafter.config import drafter_config_from_target  # noqa: E402
from dflash_train.train.optim.optimizer import build_optimizer  # noqa: E402
from dflash_train.train.state import background  # noqa: E402
from dflash_train.train.state.checkpoint import Checkpointer, DrafterState, TrainProgress  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="1 drafter layer, 2 rounds (seconds)")
    p.add_argument("--layers", type=int, help="drafter layers (default 6, the gpu recipe's; 1 with --small)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 5; 2 with --small)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    a.layers = a.layers or (1 if a.small else 6)
    a.rounds = a.rounds or (2 if a.small else 5)
    return a


def build(layers: int):
    """A drafter at SmolLM2's width and the gpu recipe's optimizer, one step taken (its moments exist)."""
    target = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152)
    drafter = DFlashDrafter(drafter_config_from_target(target, num_layers=layers, block_size=8, mask_token_id=16,
                                                       num_taps=5))
    optimizer, scheduler = build_optimizer(drafter.named_parameters(), recipes.gpu().optim, 1000, master_weights=True)
    for p in drafter.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    states = {"train": TrainProgress(), "optimizer": optimizer, "scheduler": scheduler}  # torch's: Stateful
    return DrafterState(drafter, optimizer), states


BESIDE_S = 0.25


def loop_rate(seconds: float) -> float:
    """Iterations a second of a pure-Python loop (the host side of a training step) over `seconds`."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += 1
    return n / seconds


def rounds(a, b: C.Bench) -> None:
    model, states = build(a.layers)
    b.figure("params_m", sum(p.numel() for p in model.drafter.parameters()) / 1e6)
    held = {"caller": [], "background": []}
    done, beside = [], []
    with tempfile.TemporaryDirectory(prefix="checkpoint-write-") as folder:
        for r in range(a.rounds):
            for kind in held:
                ckpt = Checkpointer(Path(folder) / f"{kind}{r}", keep_last=1)
                t0 = time.perf_counter()
                ckpt.save(100, model, states, {}, background_write=kind == "background")
                held[kind].append(time.perf_counter() - t0)
                if kind == "background":
                    beside.append(loop_rate(BESIDE_S))  # the child writes for longer than this (`done`)
                    ckpt.wait()
                    done.append(time.perf_counter() - t0)
            alone = loop_rate(BESIDE_S)
            b.log(f"round {r + 1}/{a.rounds}: save held the loop {held['caller'][-1]:.3f} s in the caller, "
                  f"{held['background'][-1]:.3f} s with a child (written {done[-1]:.3f} s after); a loop beside "
                  f"the child ran at {beside[-1] / alone:.2f} of its rate alone")
            beside[-1] /= alone
        size = sum(f.stat().st_size for f in (Path(folder) / "caller0").rglob("*") if f.is_file())
    b.figure("checkpoint_mb", size / 1e6)
    b.figure("caller_s", C.median(held["caller"]), f"median of {a.rounds}: save holds the loop")
    b.figure("background_s", C.median(held["background"]), "save holds the loop (snapshot + fork)")
    b.figure("background_done_s", C.median(done), "until the child has written, hashed, renamed and linked it")
    b.figure("loop_rate_beside", C.median(beside), "a Python loop's rate beside the child / alone")
    b.figure("ratio", b.figures["caller_s"] / max(b.figures["background_s"], 1e-9), "caller / background hold")


def main(argv=None) -> int:
    a = parse(argv)
    b = C.Bench("checkpoint_write", a)
    if not background.supported():
        return b.finish("background writes need fork (Linux)", a.json)
    with b.phase("time"):
        rounds(a, b)
    return b.finish(summary(b.figures), a.json)


def summary(f: dict) -> str:
    if "ratio" not in f:
        return "no timings"
    return (f"a {f['checkpoint_mb']:.0f} MB checkpoint held the loop {f['caller_s']:.3f} s written in the caller, "
            f"{f['background_s']:.3f} s with a forked writer ({f['ratio']:.1f}x less; written "
            f"{f['background_done_s']:.2f} s after)")


if __name__ == "__main__":
    sys.exit(main())
