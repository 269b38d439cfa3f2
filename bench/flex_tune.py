"""Tune flex_attention for the DFlash training mask: fwd+bwd time of the compiled kernel at the
step's shapes, with inductor's default block sizes, with `max-autotune` (which prints the
candidates it timed), and with explicit `kernel_options` given as JSON.

    python bench/flex_tune.py                                    # paper shapes, one H200
    python bench/flex_tune.py --options '[{"BLOCK_M": 64, "BLOCK_N": 64}]' --no-autotune
    python bench/flex_tune.py --small                           # CPU: forward only, seconds

docs/PERF.md records the sweeps; none has beaten the default by enough to adopt yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _common as C  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_shape_args(p)
    p.add_argument("--options", default="[]", help="JSON list of kernel_options dicts to time")
    p.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None,
                   help="also time mode=max-autotune-no-cudagraphs (default: on CUDA)")
    p.add_argument("--expanded-kv", action="store_true",
                   help="also time K/V repeated to the query heads (no GQA in the kernel)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions of each variant")
    p.add_argument("--json", help="write the figures to this JSON file")
    a = p.parse_args(argv)
    C.fill_shape_defaults(a)
    return a


def attention_inputs(a, device: torch.device):
    """q/k/v/grad at the drafter's attention shapes and the real DFlash BlockMask."""
    from dflash_train.model.drafter.attention import MaskSpec, flex_block_mask

    tcfg = C.target_config(a.small)
    dcfg = C.drafter_config(tcfg, layers=1, block_size=a.block_size, small=a.small)
    mb = C.synthetic_microbatch(1, a.seq_len, a.anchors, tcfg.vocab_size, 8, torch.float32, device)
    spec = MaskSpec(a.seq_len, a.block_size, a.anchors, None)
    mask = flex_block_mask(spec, mb.anchors.to(device), mb.keep.to(device), compiled=device.type == "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    train = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(0)

    def rand(heads, length):
        return torch.randn(1, heads, length, dcfg.head_dim, device=device, generator=g).to(dtype)

    q, k, v = (rand(dcfg.num_heads, spec.q_len).requires_grad_(train),
               rand(dcfg.num_kv_heads, spec.kv_len).requires_grad_(train),
               rand(dcfg.num_kv_heads, spec.kv_len).requires_grad_(train))
    return q, k, v, rand(dcfg.num_heads, spec.q_len), mask, train


def time_variant(fn, inputs, reps: int, device: torch.device) -> tuple[float, float]:
    """(seconds to the first result, compile included; median seconds per fwd(+bwd))."""
    run = C.attention_runner(fn, *inputs)

    t0 = time.perf_counter()
    C.time_calls(run, 2, device)
    ready = time.perf_counter() - t0
    return ready, C.median(C.time_calls(run, reps, device))


def compiled_flex(mode: str | None, options: dict | None, expand_kv: bool = False):
    """Compiled flex fwd(+bwd); expand_kv repeats K/V to the query heads first (the repeat and
    its backward, a sum over the group, are timed too)."""
    from torch.nn.attention.flex_attention import flex_attention

    def call(q, k, v, mask):
        if expand_kv:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)

    return torch.compile(call, dynamic=False, mode=mode)


def main(argv=None) -> int:
    a = parse(argv)
    b, device = C.start("flex_tune", a)
    torch._dynamo.config.recompile_limit = 64  # one graph per variant, on purpose
    with b.phase("build"):
        inputs = attention_inputs(a, device)
        q, k = inputs[0], inputs[1]
        b.log(f"q {tuple(q.shape)}, kv {tuple(k.shape)}, {q.dtype}, {'fwd+bwd' if inputs[5] else 'fwd only'}")
    variants = [("default", None, None)]
    variants += [(f"options {json.dumps(o)}", None, o) for o in json.loads(a.options)]
    if a.expanded_kv:
        variants.append(("expanded kv", "expanded", None))
    if a.autotune if a.autotune is not None else device.type == "cuda":
        variants.append(("max-autotune", "max-autotune-no-cudagraphs", None))
    results = {}
    for i, (name, mode, options) in enumerate(variants):
        with b.phase(name):
            fn = compiled_flex(None, None, expand_kv=True) if mode == "expanded" else compiled_flex(mode, options)
            ready, med = time_variant(fn, inputs, a.reps, device)
            results[name] = med
            b.log(f"{name}: {med * 1e3:.3f} ms (ready after {ready:.1f}s)")
            b.figure(f"variant{i}_ms", med * 1e3, name)
    if not results:
        return b.finish("no variant ran", a.json)
    best = min(results, key=results.get)
    return b.finish(f"best {best}: {results[best] * 1e3:.3f} ms vs default "
                    f"{results.get('default', float('nan')) * 1e3:.3f} ms", a.json)


if __name__ == "__main__":
    sys.exit(main())
