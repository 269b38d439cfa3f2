"""The eval's train/serve check alone: simulated decode walks (and the confidence head's calibration) on decoded text.

After decoding, the eval re-reads every (prompt, output) pair: the target's taps over the whole text, the drafter
at every eligible anchor, greedy acceptance per anchor, the decode walk (train/watch/simulate.py). On an H200 this
took 13-18 s of the `gpu` recipe's 74-84-s eval for 144 prompts (session 28) when it ran one sequence at a time.
This script times it on the real target with a DSpark drafter at the recipe's shapes (random weights: the work
does not depend on them), the prompts of the eval's sets, and outputs of `--new-tokens` tokens drawn at random,
batched (`simulate.SIM_BATCH_TOKENS`) and one sequence at a time (`--budget 1`).

    python bench/sim_walks.py                       # 2 sets x 24 prompts, 64 tokens, on CUDA if present
    python bench/sim_walks.py --budget 1            # one sequence at a time
    python bench/sim_walks.py --small               # 4 prompts, 1 layer (seconds; the test)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C  # noqa: E402
from dflash_train.eval.evaluate import encode_prompts  # noqa: E402
from dflash_train.eval.prompt_sets import load_prompt_sets  # noqa: E402
from dflash_train.model.drafter.config import drafter_config_from_target  # noqa: E402
from dflash_train.model.drafter.heads.architectures import build_drafter  # noqa: E402
from dflash_train.model.target.load import load_target  # noqa: E402
from dflash_train.train.step import StepContext  # noqa: E402
from dflash_train.train.watch import simulate  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    C.add_target_set_args(p, "4 prompts of one set, 1 drafter layer, 16 new tokens")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=6, help="drafter layers (the gpu recipe: 6)")
    p.add_argument("--block-size", type=int, default=8, help="the gpu recipe: DSpark at block 8")
    p.add_argument("--budget", type=int, help="padded tokens a batch holds (default simulate.SIM_BATCH_TOKENS)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


def pairs_of(target, sets: dict, new_tokens: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for prompts in sets.values():
        for ids in encode_prompts(target.tokenizer, prompts, None, torch.device("cpu")):
            out = torch.randint(0, target.config.vocab_size, (new_tokens,), generator=g).tolist()
            pairs.append((ids[0].tolist(), out))
    return pairs


def main(argv=None) -> int:
    a = parse(argv)
    b, device = C.start("sim_walks", a)
    sets_spec, num, new, layers = ("chitchat", 4, 16, 1) if a.small else (a.sets, a.num_prompts, a.new_tokens, a.layers)
    with b.phase("target, drafter, text"):
        target = load_target(a.target, device=device)
        cfg = drafter_config_from_target(target.config, num_layers=layers, block_size=a.block_size,
                                         mask_token_id=0, arch="dspark")
        drafter = build_drafter(cfg).to(device=device, dtype=target.dtype)
        drafter.reset_parameters(std=0.02, generator=torch.Generator().manual_seed(1))
        ctx = StepContext(embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight,
                          drafter=drafter.config, gamma=1.0, chunk_tokens=4096, backend="sdpa", device=device,
                          autocast_dtype=None, head=drafter)
        pairs = pairs_of(target, load_prompt_sets(sets_spec, num), new)
        b.log(f"{len(pairs)} pairs, {sum(len(p) + len(o) for p, o in pairs)} tokens, on {device} in {target.dtype}")
    if not b.ok("target, drafter, text"):
        return b.finish("no target or text", a.json)
    if a.budget:
        simulate.SIM_BATCH_TOKENS = a.budget  # read at each call
    seconds = []
    with b.phase("simulated walks"):
        check = simulate.simulator(drafter, target, ctx)
        for _ in range(a.reps + 1):  # the first is a warm-up
            C.sync(device)
            t0 = time.perf_counter()
            figures = check(pairs)
            C.sync(device)
            seconds.append(time.perf_counter() - t0)
        budget = getattr(simulate, "SIM_BATCH_TOKENS", None)  # None: a tree from before the batches (one at a time)
        b.figure("seconds", statistics.median(seconds[1:]), f"median of {a.reps}; {len(pairs)} pairs, "
                 + (f"batches of up to {budget} padded tokens" if budget else "one sequence at a time"))
        b.figure("sim_tau", figures["sim_tau"], "a random drafter's: ~1")
    return b.finish(f"{len(pairs)} pairs in {statistics.median(seconds[1:]):.2f} s", a.json)


if __name__ == "__main__":
    sys.exit(main())
