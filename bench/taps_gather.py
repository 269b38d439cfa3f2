"""A step's stored taps made ready for the drafter: the per-sample padding the trainer used before
(`TapsSpec.padded` of each sample's rows, then a pinned copy for the transfer) against the packed rows
of `train/feed/packed.py` (one pass into pinned host memory, or one gather on the GPU), at the `gpu`
recipe's shapes: 32 sequences of up to 320 tokens, taps [5 x 576] and the final hidden [576] in bf16.

    python bench/taps_gather.py                 # CPU routes; the GPU routes too where CUDA is
    python bench/taps_gather.py --small         # 64 samples, 4 steps a round (seconds)

Each figure is the median over rounds of the mean over steps; the routes alternate round by round.
On a GPU each route ends with its tensors on the device (what the step reads), synchronised.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C  # noqa: E402
from dflash_train.train.feed.batching import host_to_device  # noqa: E402
from dflash_train.train.feed.packed import PackedRows  # noqa: E402
from dflash_train.train.feed.taps import FINAL_HIDDEN, StoredRows, TapsSpec, TensorField  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="64 samples, 4 steps a round")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--samples", type=int, help="stored samples (default 2048; 64 with --small)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=320, help="padded length")
    p.add_argument("--width", type=int, default=5 * 576, help="taps per token (K x H)")
    p.add_argument("--hidden", type=int, default=576, help="final hidden per token")
    p.add_argument("--steps", type=int, help="steps a round (default 20; 4 with --small)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    a.samples = a.samples or (64 if a.small else 2048)
    a.steps = a.steps or (4 if a.small else 20)
    return a


def stored(a) -> tuple[PackedRows, TapsSpec]:
    spec = TapsSpec((TensorField("taps", a.width, torch.bfloat16), TensorField(FINAL_HIDDEN, a.hidden, torch.bfloat16)))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(a.seq_len // 2, a.seq_len + 1, (a.samples,), generator=gen).tolist()
    flat = {f.name: torch.randn(sum(lengths), f.width, generator=gen).to(f.dtype) for f in spec.fields}
    return PackedRows.of_lengths(flat, lengths), spec


def routes(packed: PackedRows, spec: TapsSpec, device: torch.device) -> dict:
    """name -> fn(indices, seq_len): the step's tensors where the step reads them."""
    per_sample = StoredRows(lambda i: packed[i], len(packed))
    cuda = device.type == "cuda"

    def moved(tensors: dict) -> dict:
        return {k: host_to_device(t, device) for k, t in tensors.items()}

    out = {"per_sample": lambda ix, s: moved(per_sample.padded(ix, s, spec)),
           "packed_host": lambda ix, s: moved(packed.padded(ix, s, spec, pinned=cuda))}
    if cuda:
        on_device = packed.to(device)
        out["packed_device"] = lambda ix, s: on_device.padded(ix, s, spec)
    return out


def main(argv=None) -> int:
    a = parse(argv)
    b, device = C.start("taps_gather", a)
    packed, spec = stored(a)
    b.figure("step_mb", a.batch * a.seq_len * spec.bytes_per_token / 1e6, "bytes of one step's stored tensors")
    fns, gen = routes(packed, spec, device), torch.Generator().manual_seed(1)
    seconds = {k: [] for k in fns}
    for r in range(a.rounds + 1):  # round 0 warms up (pinned pools, allocator)
        steps = [torch.randperm(len(packed), generator=gen)[:a.batch].tolist() for _ in range(a.steps)]
        for name, fn in fns.items():
            C.sync(device)
            t0 = time.perf_counter()
            for indices in steps:
                fn(indices, a.seq_len)
            C.sync(device)
            if r:
                seconds[name].append((time.perf_counter() - t0) / a.steps)
    for name in fns:
        b.figure(f"{name}_ms", C.median(seconds[name]) * 1e3, f"median of {a.rounds} rounds of {a.steps} steps")
    b.figure("speedup_host", b.figures["per_sample_ms"] / b.figures["packed_host_ms"], "per_sample / packed_host")
    if "packed_device_ms" in b.figures:
        b.figure("speedup_device", b.figures["per_sample_ms"] / b.figures["packed_device_ms"],
                 "per_sample / packed_device")
    return b.finish(f"{', '.join(f'{k} {C.median(v) * 1e3:.1f} ms' for k, v in seconds.items())} a step on {device}",
                    a.json)


if __name__ == "__main__":
    sys.exit(main())
