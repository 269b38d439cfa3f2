"""Shared pieces of the bench scripts: repo path, phases that survive failures, timing, the
measured matmul peak, random Qwen3-8B-shaped targets and drafters, synthetic batches, reporting.

Every script prints progress lines `[name +12s] ...` (flushed), one `RESULT key=value` line per
figure, and ends with one `VERDICT name: ...` line. A failing phase prints `PHASE FAILED ...` and
the script goes on with what does not depend on it; the exit status is 0 only if no phase failed.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench._bench import Bench, environment, say, sync  # noqa: E402,F401 - the scripts reach them as C.<name>
# compile health and kernel profiles live in bench/_health.py; the scripts reach them as C.<name>
from bench._health import (call_quietly, check_compile_health, compile_health_module,  # noqa: E402,F401
                           health_snapshot, kernel_group, profile_steps)
from dflash_train import plan  # noqa: E402 - the known target shapes (pure config arithmetic)

GIB = 1024 ** 3
ISSUE_PEAK_TFLOPS = 790.0  # H200 bf16, the issue's figure
SPECULATORS = {"tok_s": 18.5e3, "s_per_step": 0.166, "peak_gib": 37.0}  # speculators 0.9.0 baseline

# Qwen3-8B shapes (the paper's target) and the tiny CPU smoke shapes.
PAPER_TARGET = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6)
# Qwen3-30B-A3B's shapes (dflash_train/plan.py's, the one source), every layer sparse
MOE_TARGET = {k: v for k, v in plan.QWEN3_30B_A3B.items() if k != "model_type"} | dict(rms_norm_eps=1e-6)
SMALL_MOE_TARGET = dict(MOE_TARGET, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=512, max_position_embeddings=4096)
SMALL_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6)
# SmolLM2-135M-Instruct's shapes: the `gpu` recipe's target (its drafter's width, taps and vocabulary)
SMOLLM2_TARGET = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=1e5)
TARGET_SHAPES = ("paper", "smollm2")
PAPER_MASK_TOKEN = 151669  # the z-lab Qwen3 drafters' mask token id


def start(name: str, args) -> tuple["Bench", torch.device]:
    """The opening of every single-process bench: CPU threads, the Bench, the device."""
    cpu_threads(args.small)
    return Bench(name, args), pick_device(args.small, args.device)


def add_shape_args(p, device: bool = True) -> None:
    """--small, --device and the DFlash shape options shared by the drafter-side benches; the
    defaults (paper shapes, or tiny ones with --small) are filled in by `fill_shape_defaults`."""
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU (seconds)")
    if device:
        p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--block-size", type=int, help="B (default 16; 8 with --small)")
    p.add_argument("--anchors", type=int, help="N anchors per sequence (default 512; 16 with --small)")
    p.add_argument("--seq-len", type=int, help="S (default 3072; 256 with --small)")


def add_target_set_args(p, small: str) -> None:
    """--small (`small` says what it shrinks to), --device, --target and --sets: the options of the benches that run
    the real target on the eval's prompt sets."""
    p.add_argument("--small", action="store_true", help=small)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--target", default="smollm2", help="target.model: `smollm2`, an HF dir or a .gguf file")
    p.add_argument("--sets", default="assistant,chitchat", help="eval.prompts: set names or JSONL paths")


def fill_shape_defaults(a):
    a.block_size = a.block_size or (8 if a.small else 16)
    a.anchors = a.anchors or (16 if a.small else 512)
    a.seq_len = a.seq_len or (256 if a.small else 3072)
    return a


def pick_device(small: bool, requested: str = "auto") -> torch.device:
    """`--small` runs on the CPU unless `--device cuda` is asked for; otherwise CUDA if present."""
    if requested != "auto":
        return torch.device(requested)
    if small or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def cpu_threads(small: bool) -> None:
    """The smoke runs use one thread: on small shared CPUs, 2 threads make tiny matmuls 30x slower."""
    if small and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def median(values) -> float:
    return float(statistics.median(values)) if values else float("nan")


def time_calls(fn, reps: int, device: torch.device) -> list[float]:
    """Seconds of each of `reps` calls of fn(), each bracketed by a device synchronisation."""
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def attention_runner(fn, q, k, v, grad, mask, train: bool):
    """A no-argument call of attention `fn(q, k, v, mask)`: forward + backward with `grad` when
    training (gradients reset each call), forward only under no_grad otherwise."""
    def run():
        if train:
            q.grad = k.grad = v.grad = None
            fn(q, k, v, mask).backward(grad)
        else:
            with torch.no_grad():
                fn(q, k, v, mask)
    return run


def measure_matmul_peak(device: torch.device, bench: Bench | None = None) -> tuple[float, str]:
    """Achieved matmul FLOP/s in this run: bf16 8192^3 timed with CUDA events on GPU, fp32 on CPU."""
    if device.type == "cuda":
        n, dtype, reps = 8192, torch.bfloat16, 20
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3 / reps
        label = f"bf16 {n}^3 matmul, CUDA events"
    else:
        n, dtype, reps = 512, torch.float32, 10
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        seconds = min(time_calls(lambda: a @ b, reps, device))
        label = f"fp32 {n}^3 matmul on CPU, {torch.get_num_threads()} thread(s), best of {reps}"
    flops = 2 * n ** 3 / seconds
    if bench is not None:
        bench.log(f"measured matmul peak {flops / 1e12:.3f} TFLOP/s ({label})")
    return flops, label


def measure_fp8_peak(device: torch.device, bench: Bench | None = None) -> tuple[float, str] | None:
    """Achieved float8 matmul FLOP/s: e4m3 8192^3 `torch._scaled_mm` (tensorwise scales, bf16 out),
    timed with CUDA events like the bf16 peak; None where float8 matmuls do not run (CPU, < sm89)."""
    from dflash_train.fp8 import fp8_problem

    if fp8_problem(device) is not None:
        return None
    n, reps = 8192, 20
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)

    def mm():
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        mm()
    end.record()
    torch.cuda.synchronize(device)
    flops = 2 * n ** 3 / (start.elapsed_time(end) / 1e3 / reps)
    label = f"e4m3 {n}^3 torch._scaled_mm, tensorwise scales, CUDA events"
    if bench is not None:
        bench.log(f"measured fp8 matmul peak {flops / 1e12:.3f} TFLOP/s ({label})")
    return flops, label


def add_precision_args(p) -> None:
    """--precision and --fp8-recipe, as train.precision / train.fp8_recipe (target.precision for the target)."""
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: linear layers in float8 through torchao (needs the fp8 extra and an sm89+ GPU)")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise"), default=None,
                   help="float8 scaling (default: tensorwise for the drafter, rowwise for the target)")


def peaks(bench: Bench, device: torch.device, st: dict) -> None:
    """Measure the bf16 (fp32 on CPU) and, where it runs, the fp8 matmul peak into st['peak'] and
    st['fp8_peak'], with their figures; MFU is reported against both (`report_mfu`)."""
    peak, label = measure_matmul_peak(device, bench)
    st["peak"] = peak
    bench.figure("matmul_peak_tflops", peak / 1e12, label)
    fp8 = measure_fp8_peak(device, bench)
    if fp8 is not None:
        st["fp8_peak"] = fp8[0]
        bench.figure("fp8_matmul_peak_tflops", fp8[0] / 1e12, fp8[1])


def report_mfu(bench: Bench, st: dict, flops_per_s: float, note: str) -> None:
    """MFU of model FLOPs (counted as in bf16) against the measured bf16 peak and the fp8 peak."""
    if "peak" in st:
        bench.figure("mfu", flops_per_s / st["peak"], f"vs measured bf16 matmul peak, {note}")
    if "fp8_peak" in st:
        bench.figure("mfu_vs_fp8_peak", flops_per_s / st["fp8_peak"], f"vs measured fp8 matmul peak, {note}")


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return float("nan")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------------------------------------
# Models


def target_config(small: bool, layers: int | None = None, arch: str = "qwen3", shape: str = "paper"):
    """A Qwen3Config with the Qwen3-8B shapes (or SmolLM2-135M's with shape "smollm2"), or (arch "qwen3-moe")
    a Qwen3MoeConfig with the Qwen3-30B-A3B shapes; tiny smoke shapes with `small`. SDPA attention."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if arch not in ("qwen3", "qwen3-moe"):
        raise ValueError(f"arch {arch!r}: expected qwen3 or qwen3-moe")
    moe = arch == "qwen3-moe"
    dense = SMOLLM2_TARGET if shape == "smollm2" else PAPER_TARGET
    kw = dict((SMALL_MOE_TARGET if small else MOE_TARGET) if moe else (SMALL_TARGET if small else dense))
    if layers is not None:
        kw["num_hidden_layers"] = layers
    return (Qwen3MoeConfig if moe else Qwen3Config)(**kw, attn_implementation="sdpa")


def random_target(cfg, device: torch.device, dtype: torch.dtype, std: float = 0.02):
    """A causal LM of `cfg`'s architecture with random weights, frozen, in eval mode.

    Built on the meta device and materialised with `to_empty` on the target device, then filled
    with normal(0, std) (norm weights 1): an 8B model is ready in seconds on a GPU. The rotary
    embedding's non-persistent `inv_freq` buffers, left uninitialised by `to_empty`, are copied
    from a freshly constructed rotary module.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            kind = type(module).__name__
            if kind.endswith("RMSNorm"):
                module.weight.fill_(1.0)
            elif kind.endswith("RotaryEmbedding"):
                fresh = type(module)(config=cfg)
                for buf_name, buf in fresh.named_buffers(recurse=False):
                    getattr(module, buf_name).copy_(buf.to(device=device, dtype=getattr(module, buf_name).dtype))
                if hasattr(fresh, "attention_scaling"):
                    module.attention_scaling = fresh.attention_scaling
            else:
                for param in module.parameters(recurse=False):
                    param.normal_(0.0, std, generator=generator)
    return model.eval().requires_grad_(False)


def random_drafter(dcfg, device: torch.device, std: float = 0.02):
    """The drafter of dcfg.arch in float32 (as `setup.init_drafter` makes it), random normal(0, std)
    linears, embeddings and a head's free parameters, unit norms, identity convolutions (a module's
    `reset_identity`); materialised directly on the device."""
    from dflash_train.model.drafter.heads.architectures import build_drafter
    from dflash_train.model.drafter.backbone import RMSNorm

    with torch.device("meta"):
        drafter = build_drafter(dcfg)
    drafter = drafter.to_empty(device=device).float()
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, std, generator=generator)
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif hasattr(module, "reset_identity"):  # a head's convolutions that start as the identity
                module.reset_identity()
    return drafter


def drafter_config(tcfg, *, layers: int, block_size: int, small: bool, arch: str = "dflash",
                   sliding_window: int | None = None):
    from dflash_train.model.drafter.heads.architectures import head
    from dflash_train.model.drafter.config import drafter_config_from_target

    mask_id = PAPER_MASK_TOKEN if tcfg.vocab_size > PAPER_MASK_TOKEN and not small else tcfg.vocab_size - 1
    return drafter_config_from_target(tcfg, num_layers=layers, block_size=block_size, mask_token_id=mask_id,
                                      arch=arch, sliding_window=sliding_window,
                                      head_settings=dict(head(arch).small) if small else None)


def synthetic_ids(rows: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (rows, seq_len), generator=g)


def synthetic_microbatch(rows: int, seq_len: int, num_anchors: int, vocab: int, taps_width: int,
                         taps_dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A MicroBatch of random ids, loss on every position (anchors uniform over the sequence),
    anchors drawn by the package's `sample_anchors`, random taps already on the device."""
    from dflash_train.data.anchors import sample_anchors
    from dflash_train.train.feed.batching import MicroBatch

    input_ids = synthetic_ids(rows, seq_len, vocab, seed)
    loss_mask = torch.ones(rows, seq_len, dtype=torch.long)
    anchors = torch.zeros(rows, num_anchors, dtype=torch.long)
    keep = torch.zeros(rows, num_anchors, dtype=torch.bool)
    for r in range(rows):
        anchors[r], keep[r] = sample_anchors(loss_mask[r], num_anchors, torch.Generator().manual_seed(seed + r))
    taps = (torch.randn(rows, seq_len, taps_width, device=device, dtype=torch.float32)).to(taps_dtype)
    return MicroBatch([f"bench{seed}-{r}" for r in range(rows)], input_ids, loss_mask, loss_mask.clone(),
                      anchors, keep, {"taps": taps})


def mean_context(mb) -> float:
    """Mean number of context positions a block sees (its anchor position), over kept anchors."""
    kept = mb.anchors[mb.keep]
    return float(kept.float().mean()) if kept.numel() else 0.0


def step_context(dcfg, embed, lm_head, device: torch.device, backend: str, chunk_tokens: int,
                 dp_group=None, num_drafters: int = 1, compile_loss: bool = False, persistent_masks=None,
                 head=None, weighting: str = "decay", loss=None):
    from dflash_train.config import derived_gamma
    from dflash_train.train.step import StepContext

    return StepContext(embed_weight=embed, lm_head_weight=lm_head, drafter=dcfg,
                       gamma=derived_gamma(dcfg.block_size, None), chunk_tokens=chunk_tokens, backend=backend,
                       device=device, autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                       dp_group=dp_group, num_drafters=num_drafters, compile_loss=compile_loss,
                       persistent_masks=persistent_masks, head=head, weighting=weighting,
                       **({"loss": loss} if loss is not None else {}))


def frozen_embeddings(vocab: int, hidden: int, device: torch.device, dtype: torch.dtype, std: float = 0.02):
    """Random stand-ins for the target's (untied) embedding and lm_head, frozen."""
    g = torch.Generator(device=device).manual_seed(1)
    embed = torch.empty(vocab, hidden, device=device, dtype=dtype).normal_(0, std, generator=g)
    lm_head = torch.empty(vocab, hidden, device=device, dtype=dtype).normal_(0, std, generator=g)
    return embed, lm_head


def flops_for(tcfg, dcfg, *, seq_len: int, num_anchors: int, batch: int, mean_ctx: float | None = None,
              teacher: bool = False) -> dict:
    """`bench/flops.py::dflash_flops` for these configs: DFlash's count (`drafter["train"]`) and the
    architecture's own (`drafter["train_arch"]`: DSpark's B drafted rows, Markov bias and confidence
    head; the target's logits of a KL/TV loss with `teacher`)."""
    from bench.flops import dflash_flops

    arch = getattr(dcfg, "arch", "dflash")
    return dflash_flops(hidden=tcfg.hidden_size, num_heads=tcfg.num_attention_heads,
                        num_kv_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
                        intermediate=dcfg.intermediate_size, vocab=tcfg.vocab_size, drafter_layers=dcfg.num_layers,
                        seq_len=seq_len, num_anchors=num_anchors, block_size=dcfg.block_size,
                        target_layers=tcfg.num_hidden_layers, tap_layers=dcfg.target_layer_ids, batch=batch,
                        mean_context=mean_ctx, tied_embeddings=bool(tcfg.tie_word_embeddings),
                        drafted=dcfg.block_size if arch == "dspark" else None, teacher=teacher,
                        markov_rank=dcfg.markov_rank if arch == "dspark" else 0)


def muon_flops(dcfg, iterations: int, iteration: str = "newton_schulz", gram_blocks: int | None = None) -> float:
    """Newton-Schulz FLOPs of one Muon step over the drafter's hidden matrices (`bench/flops.py`), the
    Gram form's where `iteration` is gram, with `gram_blocks` symmetric blocks where gram_symmetric."""
    from bench.flops import drafter_matrix_shapes, newton_schulz_flops

    shapes = drafter_matrix_shapes(dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim,
                                   dcfg.intermediate_size, dcfg.num_layers, dcfg.num_taps)
    return newton_schulz_flops(shapes, iterations, iteration, gram_blocks)


def compile_counters() -> dict:
    """Dynamo's process counters: graphs compiled, graph breaks, recompiles seen so far."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return {}
    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "calls_captured": int(counters["stats"].get("calls_captured", 0))}


def fmt_rate(tok_s: float) -> str:
    if not math.isfinite(tok_s):
        return "n/a"
    return f"{tok_s / 1e3:.1f}K tok/s" if tok_s >= 1e3 else f"{tok_s:.1f} tok/s"
