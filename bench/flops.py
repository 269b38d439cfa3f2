"""FLOP counts of a DFlash drafter train step and of the target's tapped prefill, from shapes.

    python bench/flops.py                      # paper config, checked against the issue's figures
    python bench/flops.py --block-size 32 --anchors 64
    python bench/flops.py --small --json out.json

`dflash_flops` is the one function the other benchmarks use for MFU. Conventions (all stated
again in its docstring): a matmul [m, k] x [k, n] is 2mkn FLOPs; elementwise work (norms, RoPE,
softmax, SiLU, the optimizer) and embedding lookups count zero; a training step is 3x the forward
for matmuls whose weights train (forward, grad w.r.t. input, grad w.r.t. weight), 2x where only one
of the two gradients exists (the frozen lm_head: input grad only; fc: its input, the taps, has no
grad, so weight grad only); drafter attention is counted over the VISIBLE entries of the DFlash
mask, model FLOPs (no recomputation), not over the full N*B x (S + N*B) grid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUON_ITERATIONS = ("newton_schulz", "gram", "gram_symmetric")  # the forms; the coefficients cost the same

# The issue's reference figures (Issue 8), per sequence, paper config.
ISSUE_DRAFTER_TFLOP = 72.5
ISSUE_TARGET_TFLOP = 53.1
ISSUE_PEAK_TFLOPS = 790.0  # H200 bf16 dense, as measured/quoted in the issue

PAPER = dict(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
             target_layers=36, tap_layers=(1, 9, 17, 25, 33), drafter_layers=5, seq_len=3072,
             num_anchors=512, block_size=16)
SMALL = dict(hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128, vocab=512,
             target_layers=8, tap_layers=(1, 2, 3, 4, 5), drafter_layers=2, seq_len=256,
             num_anchors=16, block_size=8)


def dflash_flops(*, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 vocab: int, drafter_layers: int, seq_len: int, num_anchors: int, block_size: int,
                 target_layers: int, tap_layers=(1, 9, 17, 25, 33), batch: int = 1,
                 mean_context: float | None = None, attention: str = "visible",
                 tied_embeddings: bool = False, target_mlp_params: int | None = None,
                 drafted: int | None = None, teacher: bool = False, markov_rank: int = 0) -> dict:
    """FLOPs of one DFlash drafter train step and of the target prefill that feeds it.

    Shapes (the drafter shares the target's width, heads and vocabulary, spec 1.1):
      hidden H, num_heads Hq, num_kv_heads Hkv, head_dim d, intermediate I (MLP), vocab V,
      drafter_layers L_d, target_layers L_t, tap_layers (z-lab ids: outputs of decoder layers),
      seq_len S (context positions), num_anchors N, block_size B, batch (sequences).

    Drafter, per sequence, forward (Q = N*B block tokens, K = len(tap_layers)):
      per layer  q_proj, o_proj        2 * Q * H * Hq*d            each
                 k_proj, v_proj block  2 * Q * H * Hkv*d           each
                 k_proj, v_proj ctx    2 * S * H * Hkv*d           each (context K/V, spec 1.1)
                 attention             4 * Hq * d * visible        (QK^T scores + PV values)
                 MLP                   3 * 2 * Q * H * I           (gate, up, down)
      fc         2 * S * (K*H) * H     (once per step, shared by all layers)
      lm_head    2 * N*(B-1) * H * V   (slot 0 of each block is never predicted)
    `visible` = number of (query, key) pairs the DFlash mask lets through (spec 2.4): each of the
    B queries of block j sees the context strictly before its anchor (a_j positions) and its own
    block (B keys), so visible = B * sum_j (a_j + B). With `mean_context` = mean anchor position
    (default (S-1)/2: anchors uniform over the sequence) that is Q * (mean_context + B).
    `attention="full"` counts the full grid Q * (S + Q) instead (what a dense kernel would do).
    Train step = 3x forward for q/k/v/o, MLP and attention; 2x for fc (no grad w.r.t. the taps)
    and 2x for the frozen lm_head (no weight grad). A backward that recomputes attention scores
    (flash/flex) does 3.5x the attention forward in hardware FLOPs; that is not counted here.

    Target prefill, per sequence (causal attention: S(S+1)/2 visible pairs per head and layer):
      tapped    2 * params(layers 0..max(tap_layers)) * S + attention of those layers; this is
                what `Target.taps` runs (it stops after the last tapped layer)
      full      the whole decoder (all L_t layers), e.g. `taps(..., return_last_hidden=True)`
      issue     2 * ALL params (embedding and lm_head included) * S + causal attention of all
                layers: the convention behind the issue's 53.1 TFLOP (a full LM forward)

    `target_mlp_params` replaces the target's per-layer MLP parameter count 3*H*I: for a mixture of
    experts, the parameters a token actually runs through (router + top_k experts' gate, up, down),
    so that MFU counts active parameters only.

    The head and loss of other architectures (keys `drafter["arch"]`, `drafter["train_arch"]`; the
    plain keys keep DFlash's count, the convention of earlier figures): `drafted` = D rows per block
    through the lm_head (DSpark drafts from every slot: D = B; None: B - 1), `teacher` = the target's
    logits of every drafted row for a KL/TV loss (forward only, no gradient: 1x), `markov_rank` = r of
    DSpark's low-rank logit bias e @ M^T [rows, V] (3x: its input and its weight train) and its
    confidence head [rows, H + r] -> 1 (3x).

    Returns a dict of FLOP counts (floats) for `batch` sequences: keys `drafter` (components,
    `fwd`, `train`) and `target` (`per_layer`, `tapped`, `full_decoder`, `issue_convention`),
    plus `visible_fraction` (visible / full grid) and `tokens` (= batch * S).
    """
    if attention not in ("visible", "full"):
        raise ValueError(f"attention={attention!r}: expected visible or full")
    H, hq, hkv, d, I, V = hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab
    S, N, B, K = seq_len, num_anchors, block_size, len(tap_layers)
    Q = N * B
    q_width, kv_width = hq * d, hkv * d
    mean_ctx = (S - 1) / 2 if mean_context is None else float(mean_context)
    visible = Q * (mean_ctx + B)
    full_grid = Q * (S + Q)
    attn_pairs = visible if attention == "visible" else full_grid

    layer = {
        "q_proj": 2 * Q * H * q_width,
        "o_proj": 2 * Q * q_width * H,
        "kv_proj_block": 2 * 2 * Q * H * kv_width,
        "kv_proj_context": 2 * 2 * S * H * kv_width,
        "attention": 4 * hq * d * attn_pairs,
        "mlp": 3 * 2 * Q * H * I,
    }
    fwd = {k: v * drafter_layers for k, v in layer.items()}
    fwd["fc"] = 2 * S * (K * H) * H
    fwd["lm_head"] = 2 * N * (B - 1) * H * V
    train_factor = {k: 3 for k in fwd} | {"fc": 2, "lm_head": 2}
    drafter = {k: v * batch for k, v in fwd.items()}
    drafter["fwd"] = sum(fwd.values()) * batch
    drafter["train"] = sum(v * train_factor[k] for k, v in fwd.items()) * batch
    rows = N * (B - 1 if drafted is None else drafted)
    head = {"lm_head": (2 * rows * H * V, 2), "teacher_logits": (2 * rows * H * V if teacher else 0, 1),
            "markov_bias": (2 * rows * markov_rank * V, 3),
            "confidence": (2 * rows * (H + markov_rank) if markov_rank else 0, 3)}
    drafter["head"] = {k: v * batch for k, (v, _) in head.items()}
    other = sum(v * train_factor[k] for k, v in fwd.items() if k != "lm_head")
    drafter["train_arch"] = (other + sum(v * f for v, f in head.values())) * batch

    mlp_params = 3 * H * I if target_mlp_params is None else target_mlp_params
    per_layer_params = H * q_width + 2 * H * kv_width + q_width * H + mlp_params
    causal_pairs = S * (S + 1) / 2
    per_layer = 2 * per_layer_params * S + 4 * hq * d * causal_pairs
    used_layers = max(tap_layers) + 1
    embed_params = V * H * (1 if tied_embeddings else 2)
    target = {
        "per_layer": per_layer * batch,
        "tapped": per_layer * used_layers * batch,
        "tapped_layers": used_layers,
        "full_decoder": per_layer * target_layers * batch,
        "issue_convention": (2 * (per_layer_params * target_layers + embed_params) * S
                             + 4 * hq * d * causal_pairs * target_layers) * batch,
    }
    return {"drafter": drafter, "target": target, "visible_fraction": visible / full_grid,
            "tokens": batch * S, "attention_convention": attention}


def newton_schulz_flops(shapes, iterations: int = 5, iteration: str = "newton_schulz",
                        gram_blocks: int | None = None) -> float:
    """FLOPs of Muon's orthogonalisation of matrices `shapes` [(A, B), ...] per optimizer step
    (`optim.muon_iteration`): per iteration on the short side m <= n, X X^T (2 m^2 n), the quintic's
    G G (2 m^3) and (.) X (2 m^2 n); `gram` runs the Gram form on the wide matrices where it takes
    fewer FLOPs (5 iterations: 28 m^3 + 8 m^2 n); `gram_symmetric` its symmetric products on the upper
    block triangle (`gram_blocks`, default optim.muon_gram_blocks), on every shape where that is cheaper.
    The one count: train/optim/muon.py `ns_flops`, checked against torch's FlopCounterMode in
    tests/train/optim/test_muon_step.py and test_muon_symmetric.py."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from dflash_train.config import OptimConfig
    from dflash_train.train.optim.muon import step_ns_flops

    blocks = OptimConfig().muon_gram_blocks if gram_blocks is None else gram_blocks
    return float(step_ns_flops(shapes, iterations, iteration, blocks))


def drafter_matrix_shapes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                          drafter_layers: int, num_taps: int) -> list[tuple[int, int]]:
    """The hidden matrices Muon takes in a DFlash drafter (q, k, v, o, gate, up, down per layer; fc)."""
    H, q, kv = hidden, num_heads * head_dim, num_kv_heads * head_dim
    layer = [(q, H), (kv, H), (kv, H), (H, q), (intermediate, H), (intermediate, H), (H, intermediate)]
    return layer * drafter_layers + [(H, num_taps * H)]


def paper_check() -> dict:
    """The paper config against the issue's figures, and the roofline arithmetic of docs/PERF.md."""
    shapes = {k: v for k, v in PAPER.items()}
    f = dflash_flops(**shapes)
    full = dflash_flops(**shapes, attention="full")
    d, t = f["drafter"]["train"] / 1e12, f["target"]["issue_convention"] / 1e12
    alt = {  # the same step under other conventions, to show where the issue's figure sits
        "fc_3x": d + f["drafter"]["fc"] / 1e12,
        "attention_bwd_recompute_3.5x": d + 0.5 * f["drafter"]["attention"] / 1e12,
        "fc_3x_and_attention_3.5x": d + (f["drafter"]["fc"] + 0.5 * f["drafter"]["attention"]) / 1e12,
        "full_grid_attention": full["drafter"]["train"] / 1e12,
        "lm_head_3x": d + f["drafter"]["lm_head"] / 1e12,
    }
    S = PAPER["seq_len"]
    peak = ISSUE_PEAK_TFLOPS
    return {
        "drafter_train_tflop": d, "issue_drafter_tflop": ISSUE_DRAFTER_TFLOP,
        "drafter_rel_diff": d / ISSUE_DRAFTER_TFLOP - 1,
        "target_issue_convention_tflop": t, "issue_target_tflop": ISSUE_TARGET_TFLOP,
        "target_rel_diff": t / ISSUE_TARGET_TFLOP - 1,
        "target_tapped_tflop": f["target"]["tapped"] / 1e12,
        "target_full_decoder_tflop": f["target"]["full_decoder"] / 1e12,
        "drafter_alternatives_tflop": alt,
        "visible_fraction": f["visible_fraction"],
        "roofline_tok_s": {
            "drafter_gpu": peak / d * S * 1e0,
            "target_gpu_issue_convention": peak / t * S,
            "target_gpu_tapped": peak / (f["target"]["tapped"] / 1e12) * S,
            "pair_balanced_2gpu": 2 * peak / (d + t) * S,
            "pipeline_1target_1drafter": min(peak / d, peak / t) * S,
        },
    }


def _components(f: dict) -> str:
    dr = f["drafter"]
    keys = ["q_proj", "o_proj", "kv_proj_block", "kv_proj_context", "attention", "mlp", "fc", "lm_head"]
    return ", ".join(f"{k} {dr[k] / 1e12:.2f}" for k in keys)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="the tiny CPU smoke shapes")
    p.add_argument("--block-size", type=int)
    p.add_argument("--anchors", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--layers", type=int, help="drafter layers")
    p.add_argument("--attention", choices=("visible", "full"), default="visible")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    shapes = dict(SMALL if a.small else PAPER)
    for key, val in (("block_size", a.block_size), ("num_anchors", a.anchors), ("seq_len", a.seq_len),
                     ("drafter_layers", a.layers)):
        if val is not None:
            shapes[key] = val
    f = dflash_flops(**shapes, attention=a.attention)
    S = shapes["seq_len"]
    print(f"[flops] shapes: {shapes}", flush=True)
    print(f"[flops] drafter fwd components (TFLOP/seq): {_components(f)}", flush=True)
    out = {"shapes": shapes, "flops": f}
    print(f"RESULT drafter_fwd_tflop={f['drafter']['fwd'] / 1e12:.4g}")
    print(f"RESULT drafter_train_tflop={f['drafter']['train'] / 1e12:.4g}")
    print(f"RESULT target_tapped_tflop={f['target']['tapped'] / 1e12:.4g}")
    print(f"RESULT target_full_decoder_tflop={f['target']['full_decoder'] / 1e12:.4g}")
    print(f"RESULT target_issue_convention_tflop={f['target']['issue_convention'] / 1e12:.4g}")
    print(f"RESULT visible_fraction={f['visible_fraction']:.4g}")
    print(f"RESULT roofline_drafter_tok_s={ISSUE_PEAK_TFLOPS * 1e12 / f['drafter']['train'] * S:.4g}")
    matrices = drafter_matrix_shapes(shapes["hidden"], shapes["num_heads"], shapes["num_kv_heads"], shapes["head_dim"],
                                     shapes["intermediate"], shapes["drafter_layers"], len(shapes["tap_layers"]))
    out["muon_ns_tflop"] = {kind: newton_schulz_flops(matrices, 5, kind) / 1e12 for kind in MUON_ITERATIONS}
    for kind, tflop in out["muon_ns_tflop"].items():
        print(f"RESULT muon_ns_tflop_{kind}={tflop:.4g}  # Muon's 5 iterations per optimizer step (>= "
              f"{tflop / ISSUE_PEAK_TFLOPS * 1e3:.3g} ms at {ISSUE_PEAK_TFLOPS:.0f} TFLOP/s)")
    verdict = "OK"
    if not a.small and shapes == PAPER:
        check = paper_check()
        out["paper_check"] = check
        for k, v in check["drafter_alternatives_tflop"].items():
            print(f"[flops] drafter train under convention {k}: {v:.2f} TFLOP/seq", flush=True)
        for k, v in check["roofline_tok_s"].items():
            print(f"[flops] roofline at {ISSUE_PEAK_TFLOPS:.0f} TFLOP/s, {k}: {v / 1e3:.1f}K tok/s", flush=True)
        ok = abs(check["drafter_rel_diff"]) < 0.03 and abs(check["target_rel_diff"]) < 0.03
        verdict = (f"{'OK' if ok else 'MISMATCH'}: drafter {check['drafter_train_tflop']:.2f} TFLOP/seq vs issue "
                   f"{ISSUE_DRAFTER_TFLOP} ({check['drafter_rel_diff']:+.1%}); target (issue convention) "
                   f"{check['target_issue_convention_tflop']:.2f} vs {ISSUE_TARGET_TFLOP} "
                   f"({check['target_rel_diff']:+.1%}); tapped prefill actually runs "
                   f"{check['target_tapped_tflop']:.2f}")
    else:
        verdict = (f"OK: drafter {f['drafter']['train'] / 1e12:.4g} TFLOP/step, target tapped "
                   f"{f['target']['tapped'] / 1e12:.4g} TFLOP")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2, default=float))
    print(f"VERDICT flops: {verdict}", flush=True)
    return 0 if verdict.startswith("OK") else 1


if __name__ == "__main__":
    sys.exit(main())
