"""The target's tapped prefill: a random Qwen3-8B-shaped model through `Target.taps`.

    python bench/target_prefill.py                     # one H200: batch 4 x S 3072, bf16, taps 1,9,17,25,33
    python bench/target_prefill.py --batch 1           # the pipeline's micro-batch
    python bench/target_prefill.py --small             # tiny shapes, CPU, seconds
    python bench/target_prefill.py --precision fp8     # float8 decoder linears (torchao, sm89+), taps' error
    python bench/target_prefill.py --arch qwen3-moe    # a random Qwen3-30B-A3B-shaped mixture of experts

For a mixture of experts MFU counts active parameters only (router + the top_k experts a token is
routed to), and the experts run through transformers' default experts implementation.

Figures: tokens/s, MFU (against a bf16 matmul peak measured in the same run; model FLOPs of the
layers actually run, bench/flops.py "tapped"), peak memory, and the time saved by stopping after
the last tapped layer (`Target.taps`) versus running the whole decoder
(`taps(..., return_last_hidden=True)`). No lm_head runs in either. With `--precision fp8` the
decoder layers' linears run in float8 (`Target.quantize_fp8`, as target.precision=fp8), MFU is
reported against the fp8 peak too, and the taps' relative error against the same target's bf16
taps (per tapped layer, relative Frobenius norm over the timed batch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import _common as C  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description="tapped target prefill benchmark")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU (seconds)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--batch", type=int, help="sequences per forward (default 4; 2 with --small)")
    p.add_argument("--seq-len", type=int, help="S (default 3072; 128 with --small)")
    p.add_argument("--arch", default="qwen3", choices=("qwen3", "qwen3-moe"),
                   help="qwen3: Qwen3-8B shapes; qwen3-moe: Qwen3-30B-A3B shapes (128 experts, 8 active)")
    p.add_argument("--layers", type=int, help="target layers (default 36; 8 with --small)")
    p.add_argument("--taps", help="comma-separated z-lab tap ids (default: build_target_layer_ids(L, 5))")
    p.add_argument("--steps", type=int, help="timed forwards (default 5; 3 with --small)")
    p.add_argument("--warmup", type=int, help="warm-up forwards (default 2; 1 with --small)")
    p.add_argument("--full", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the whole decoder, for the saving of stopping after the last tap")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decoder layers as training does (default: on CUDA)")
    C.add_precision_args(p)
    p.add_argument("--profile", type=int, default=0, metavar="FORWARDS",
                   help="after timing, profile FORWARDS tapped forwards and print the kernels that take the time")
    p.add_argument("--json", help="write the figures to this JSON file")
    a = p.parse_args(argv)
    a.batch = a.batch or (2 if a.small else 4)
    a.seq_len = a.seq_len or (128 if a.small else 3072)
    a.steps = a.steps or (3 if a.small else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.small else 2)
    a.fp8_recipe = a.fp8_recipe or "rowwise"
    return a


def main(argv=None) -> int:
    a = parse(argv)
    b, device = C.start("target_prefill", a)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b.info.update(device=str(device), dtype=str(dtype), arch=a.arch, batch=a.batch, seq_len=a.seq_len, precision=a.precision,
                  fp8_recipe=a.fp8_recipe if a.precision == "fp8" else None)
    st: dict = {}

    with b.phase("build"):
        from dflash_train.model.target.taps import build_target_layer_ids
        from dflash_train.model.target.target import Target

        cfg = C.target_config(a.small, a.layers, a.arch)
        layer_ids = ([int(x) for x in a.taps.split(",")] if a.taps
                     else build_target_layer_ids(cfg.num_hidden_layers, 5))
        target = Target(model=C.random_target(cfg, device, dtype), tokenizer=None, name=f"random-{a.arch}")
        compiled = a.compile if a.compile is not None else device.type == "cuda"
        b.info["compiled"] = compiled
        ids = C.synthetic_ids(a.batch, a.seq_len, cfg.vocab_size, seed=0).to(device)
        mask = torch.ones_like(ids)
        if a.precision == "fp8":
            st["reference"] = target.taps(ids, mask, layer_ids)  # bf16 taps of the same weights (eager)
            target.quantize_fp8(a.fp8_recipe, log=b.log)  # as target.precision=fp8: before compiling
        if compiled:
            target.compile_layers()  # as the trainer does for a target that computes taps every step
        from bench.flops import dflash_flops

        shape = C.plan.target_shape(cfg)  # parameter counts, active ones for a mixture of experts

        flops = dflash_flops(hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                             num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                             intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, drafter_layers=1,
                             seq_len=a.seq_len, num_anchors=1, block_size=2, target_layers=cfg.num_hidden_layers,
                             tap_layers=layer_ids, batch=a.batch, tied_embeddings=bool(cfg.tie_word_embeddings),
                             target_mlp_params=shape.active_mlp_params)["target"]
        st.update(target=target, ids=ids, mask=mask, layer_ids=layer_ids, flops=flops)
        params = sum(p.numel() for p in target.model.parameters())
        if shape.active_params < shape.total_params:  # a mixture of experts: what a token runs through
            b.info["experts_implementation"] = str(getattr(target.model.config, "_experts_implementation", None))
            b.figure("target_active_params_b", shape.active_params / 1e9,
                     f"experts: {b.info['experts_implementation']}")
        b.log(f"target {a.arch} {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {params / 1e9:.2f}B params, {dtype}; "
              f"taps {layer_ids} -> runs {flops['tapped_layers']} layers; input {tuple(ids.shape)}")
        b.figure("target_params_b", params / 1e9)
        b.figure("tflop_per_forward_tapped", flops["tapped"] / 1e12, f"{flops['tapped_layers']} layers, causal attention")

    with b.phase("matmul peak"):
        C.peaks(b, device, st)

    def taps(full: bool = False):
        def run():
            out = st["target"].taps(st["ids"], st["mask"], st["layer_ids"], return_last_hidden=full)
            st["out"] = out
        return run

    if b.ok("build"):
        with b.phase("warm-up"):
            C.time_calls(taps(), a.warmup, device)
            out = st["out"]
            expected = (a.batch, a.seq_len, len(st["layer_ids"]) * st["target"].hidden_size)
            if tuple(out.shape) != expected:
                raise AssertionError(f"taps shape {tuple(out.shape)}, expected {expected}")
            if not torch.isfinite(out.float()).all():
                raise FloatingPointError("non-finite taps")
            if "reference" in st:
                tap_errors(b, st.pop("reference"), out, st["layer_ids"])
            st.pop("out")
            health = C.compile_health_module() if b.info["compiled"] else None
            st["counters_before"], st["health_before"] = C.compile_counters(), C.health_snapshot(health)

        with b.phase("timing (stop after last tap)"):
            C.reset_peak_memory(device)
            med = C.median(C.time_calls(taps(), a.steps, device))
            st.pop("out", None)
            tokens = a.batch * a.seq_len
            b.figure("prefill_s", med, f"batch {a.batch} x S {a.seq_len}")
            b.figure("tokens_per_s", tokens / med)
            b.figure("target_tflops_achieved", st["flops"]["tapped"] / med / 1e12)
            C.report_mfu(b, st, st["flops"]["tapped"] / med, "tapped FLOPs")
            if device.type == "cuda":
                b.figure("mfu_vs_790", st["flops"]["tapped"] / med / (C.ISSUE_PEAK_TFLOPS * 1e12))
                b.figure("peak_memory_gib", C.peak_memory_gib(device))
            st["taps_s"] = med
            st["counters_after"], st["health_after"] = C.compile_counters(), C.health_snapshot(health)
        if b.info["compiled"]:
            with b.phase("compile health"):
                C.check_compile_health(b, health, st, expect_compiled_flex=False)

        if a.full:
            with b.phase("timing (whole decoder)"):
                C.time_calls(taps(full=True), 1, device)
                full = C.median(C.time_calls(taps(full=True), a.steps, device))
                st.pop("out", None)
                b.figure("full_decoder_s", full)
                if "taps_s" in st:
                    b.figure("stop_early_saving", 1 - st["taps_s"] / full,
                             f"expected from FLOPs {1 - st['flops']['tapped'] / st['flops']['full_decoder']:.3f}")

    if a.profile and b.ok("build"):
        with b.phase("profile"):
            C.profile_steps(b, taps(), a.profile, device)
            st.pop("out", None)

    f = b.figures
    parts = [f"precision {a.precision}" + (f" ({a.fp8_recipe})" if a.precision == "fp8" else "")]
    if "tokens_per_s" in f:
        parts.append(f"{C.fmt_rate(f['tokens_per_s'])}, {f['prefill_s']:.3f} s per {a.batch}x{a.seq_len}")
    if "mfu" in f:
        parts.append(f"MFU {f['mfu']:.1%} of measured bf16 {f['matmul_peak_tflops']:.4g} TFLOP/s")
    if "mfu_vs_fp8_peak" in f:
        parts.append(f"{f['mfu_vs_fp8_peak']:.1%} of measured fp8 {f['fp8_matmul_peak_tflops']:.4g} TFLOP/s")
    if "tap_rel_err_max" in f:
        parts.append(f"taps' relative error vs bf16 <= {f['tap_rel_err_max']:.4f}")
    if "peak_memory_gib" in f:
        parts.append(f"peak {f['peak_memory_gib']:.1f} GiB")
    if "stop_early_saving" in f:
        parts.append(f"stopping after the last tap saves {f['stop_early_saving']:.1%} vs the whole decoder")
    return b.finish("; ".join(parts) or "no figures", a.json)


def tap_errors(b: C.Bench, reference: torch.Tensor, taps: torch.Tensor, layer_ids: list[int]) -> None:
    """Figures tap_rel_err_L<id> (relative Frobenius norm vs the bf16 taps) per tapped layer, and the max."""
    from dflash_train.model.target.target import tap_relative_errors

    errors = tap_relative_errors(reference, taps, len(layer_ids))
    for layer, error in zip(layer_ids, errors):
        b.figure(f"tap_rel_err_L{layer}", error, "||fp8 - bf16||_F / ||bf16||_F")
    b.figure("tap_rel_err_max", max(errors))


if __name__ == "__main__":
    sys.exit(main())
