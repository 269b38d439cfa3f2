"""Regeneration + taps throughput: the dynamic decode loop vs the fixed-shape, CUDA-graphed one
(`dflash_train/data/graph_decode.py`), on the same prompts, in one process.

    python bench/regenerate.py --model smollm2 [--prompts 2048] [--batch 1024] [--max-new 96] [--taps 5]
    python bench/regenerate.py --random-weights DIR ...   # DIR: an HF dir's config + tokenizer, no weights

`--random-weights` builds the model from DIR's config with random weights (for a machine the
weights cannot reach); such a model never ends its turn, so every row decodes all `--max-new` steps.

Prompts: the default training mix (assistant templates + chit-chat). Prints new tokens/s per arm,
the share of samples whose tokens are identical between the arms (bf16 greedy decoding flips
near-ties: 27 % identical on SmolLM2 in bf16, 100 % in float32), the largest tap difference on
identical samples (the verdict's criterion), and with `--phases` the fixed-shape decoder's phases.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._common import Bench  # noqa: E402


def _arm(bench, target, conversations, args, layer_ids, graph: bool):
    from dflash_train.data.regen_taps import regenerate_with_taps

    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    profile = cProfile.Profile() if args.profile else None
    if profile:
        profile.enable()
    tapped, report = regenerate_with_taps(target, conversations, layer_ids, args.max_new, args.batch, args.max_len,
                                          graph=graph)
    seconds = time.perf_counter() - start
    if profile:
        profile.disable()
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile)
    name = "graph" if graph else "dynamic"
    bench.figure(f"{name}_new_tok_s", report["new_tokens"] / seconds)
    bench.figure(f"{name}_seconds", seconds)
    bench.figure(f"{name}_new_tokens", report["new_tokens"], f"{report['samples']} samples")
    return tapped


def _timed_phases(enabled: bool) -> dict:
    """Wrap the fixed-shape decoder's phases in synchronized timers (seconds summed per phase)."""
    from dflash_train.data import graph_decode

    totals: dict[str, float] = {}
    if not enabled:
        return totals
    for name in ("_prefill", "_run_step", "_split", "decode"):
        inner = getattr(graph_decode.GraphDecoder, name)

        def timed(self, *a, _inner=inner, _name=name, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _inner(self, *a, **k)
            torch.cuda.synchronize()
            totals[_name] = totals.get(_name, 0.0) + time.perf_counter() - t0
            totals[_name + "_calls"] = totals.get(_name + "_calls", 0) + 1
            return out
        setattr(graph_decode.GraphDecoder, name, timed)
    return totals


def _random_target(directory: str, device: str, dtype_name: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dflash_train.model.target.target import Target

    dtype = torch.float32 if dtype_name == "float32" or device != "cuda" else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=dtype)
    return Target(model=model.eval().requires_grad_(False), tokenizer=AutoTokenizer.from_pretrained(directory))


def _compare(a, b) -> tuple[float, float]:
    """(share of samples with identical tokens, max |tap difference| relative to the tap scale on them)."""
    same = [(x, y) for x, y in zip(zip(a.samples, a.taps), zip(b.samples, b.taps)) if x[0] == y[0]]
    worst = max(((tx.float() - ty.float()).abs().max() / ty.float().abs().max().clamp_min(1e-6)).item()
                for (_, tx), (_, ty) in same) if same else float("nan")
    return len(same) / max(len(a.samples), 1), worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--max-len", type=int, default=320)
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the N top host functions per arm")
    p.add_argument("--phases", action="store_true", help="time the fixed-shape decoder's phases (syncs each step)")
    p.add_argument("--repeat", type=int, default=1, help="run each arm this many times (the first warms up)")
    p.add_argument("--random-weights", metavar="DIR", help="config + tokenizer dir; random weights")
    p.add_argument("--small", action="store_true", help="a CPU smoke run: 6 prompts, batch 4, 8 new tokens")
    p.add_argument("--dtype", default="auto", help="target dtype; float32 makes the two arms' tokens comparable")
    p.add_argument("--json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.small:
        args.prompts, args.batch, args.max_new, args.device = 6, 4, 8, "cpu"
    from dflash_train.data.corpus import default_train_conversations
    from dflash_train.model.target.load import load_target
    from dflash_train.model.target.taps import build_target_layer_ids

    bench = Bench("regenerate", args)
    target = _random_target(args.random_weights, args.device, args.dtype) if args.random_weights else \
        load_target(args.model, device=args.device, dtype=args.dtype)
    conversations = default_train_conversations(seed=0, max_samples=args.prompts)
    layer_ids = build_target_layer_ids(target.num_layers, args.taps)
    bench.log(f"target {args.model} on {target.device} ({target.dtype}), {len(conversations)} prompts, "
              f"batch {args.batch}")
    phases = _timed_phases(args.phases)
    for _ in range(args.repeat):
        graph = _arm(bench, target, conversations, args, layer_ids, graph=True)
        dynamic = _arm(bench, target, conversations, args, layer_ids, graph=False)
    if phases:
        bench.log("phases of the graph arm(s): " + " ".join(f"{k}={v:.3f}" for k, v in phases.items()))
    same, worst = _compare(graph, dynamic)
    bench.figure("identical_samples", same)
    bench.figure("max_rel_tap_diff_on_identical", worst)
    # bf16 greedy decoding flips near-ties between two attention kernels, and a flip changes the rest
    # of the row, so identical rows are informative, not a criterion (float32 equality is tested:
    # tests/data/test_graph_decode.py); the taps of identical rows must agree
    if not worst < 2e-2:
        bench.failed.append("taps of identical samples")
    if target.dtype == torch.float32 and same < 0.99:  # no bf16 near-tie flips to excuse a divergence
        bench.failed.append("identical samples in float32")
    speedup = bench.figures["graph_new_tok_s"] / bench.figures["dynamic_new_tok_s"]
    return bench.finish(f"graph decode {speedup:.2f}x the dynamic loop; taps of identical samples within "
                        f"{worst:.1e}; {same:.0%} of samples identical", args.json)


if __name__ == "__main__":
    sys.exit(main())
