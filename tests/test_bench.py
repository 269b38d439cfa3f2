"""Smoke test of the benchmarks: each bench script runs with --small on the CPU, exits 0, prints a
VERDICT line, writes its JSON, and every figure it prints is a finite number; the key ones are > 0."""

import json
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--monitor-interval=0.5"]

CASES = {
    "flops": ([sys.executable, "bench/flops.py"],
              ["drafter_train_tflop", "target_tapped_tflop", "visible_fraction", "muon_ns_tflop_newton_schulz",
               "muon_ns_tflop_gram", "muon_ns_tflop_gram_symmetric"]),
    "drafter_step": ([sys.executable, "bench/drafter_step.py", "--profile", "1"],
                     ["tokens_per_s", "step_time_median_s", "mfu", "matmul_peak_tflops", "tflop_per_step"]),
    "muon_iterations": ([sys.executable, "bench/muon_iterations.py"],
                        ["step_ms_newton_schulz", "step_ms_gram", "gram_error_ratio_max", "error_max_gram",
                         "step_ms_gram_symmetric_k4", "gram_symmetric_k4_error_ratio_max"]),
    "drafter_step_dspark_muon": ([sys.executable, "bench/drafter_step.py", "--arch", "dspark", "--block-size", "8",
                                  "--loss", "tv", "--optim", "muon", "--micro-batches", "2", "--compile-loss"],
                                 ["tokens_per_s", "mfu_arch", "tflop_per_step_arch", "muon_ns_tflop_per_step"]),
    "target_prefill": ([sys.executable, "bench/target_prefill.py", "--profile", "1"],
                       ["tokens_per_s", "prefill_s", "mfu", "full_decoder_s"]),
    "target_prefill_moe": ([sys.executable, "bench/target_prefill.py", "--arch", "qwen3-moe"],
                           ["tokens_per_s", "mfu", "target_active_params_b"]),
    "regenerate": ([sys.executable, "bench/regenerate.py"], ["graph_new_tok_s", "dynamic_new_tok_s"]),
    "spec_decode_gpu": ([sys.executable, "bench/spec_decode_gpu.py"], ["static_r0_cycle_plain_steps",
                                                                      "dynamic_r0_cycle_plain_steps"]),
    "decode_census": ([sys.executable, "bench/decode_census.py"], ["plain_kernels", "cycle_kernels",
                                                                     "cycle_over_plain_kernels"]),
    "flex_tune": ([sys.executable, "bench/flex_tune.py", "--reps", "2"], ["variant0_ms"]),
    "hash_throughput": ([sys.executable, "bench/hash_throughput.py"], ["sequential_gb_s", "parallel_gb_s", "ratio"]),
    "taps_gather": ([sys.executable, "bench/taps_gather.py"], ["per_sample_ms", "packed_host_ms", "speedup_host"]),
    "target_confidence": ([sys.executable, "bench/target_confidence.py"], ["chitchat_mean_top1", "chitchat_argmax_agrees"]),
    "sim_walks": ([sys.executable, "bench/sim_walks.py"], ["seconds", "sim_tau"]),
    "checkpoint_write": ([sys.executable, "bench/checkpoint_write.py"], ["caller_s", "background_s", "ratio"]),
    "pipeline": (TORCHRUN + ["bench/pipeline.py"],
                 ["tokens_per_s", "drafter_busy_fraction", "target_busy_fraction", "drafter_capacity_tok_s",
                  "target_capacity_tok_s"]),
}


RESULT_LINE = re.compile(r"RESULT (\w+)=(\S+)$")


def results(stdout: str) -> dict[str, float]:
    """`RESULT key=value  # note` lines -> {key: float(value)}. Matched anywhere in a line: under
    torchrun the other rank's unterminated output can precede a RESULT line on the same line."""
    figures = {}
    for line in stdout.splitlines():
        found = RESULT_LINE.search(line.split("#")[0].strip())
        if found:
            figures[found.group(1)] = float(found.group(2))
    return figures


@pytest.fixture(scope="module")
def bench_runs(request, tmp_path_factory):
    """The selected cases, started when the module starts and run as many at a time as the machine has cores: each
    is a process of one OpenMP thread, so run one by one they left a 2-core box's other core idle (~75 s of benches
    one at a time). Each test waits for its own case's process."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", "") == "test_bench_small" and item.module is request.module]
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def run(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        json_path = out / f"{name}.json"
        proc = subprocess.run(CASES[name][0] + ["--small", "--json", str(json_path)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        return proc, json_path

    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        yield {name: pool.submit(run, name) for name in names}


@pytest.mark.parametrize("name", list(CASES))
def test_bench_small(name, bench_runs):
    _, positive = CASES[name]
    proc, out = bench_runs[name].result()
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert f"VERDICT {name.removesuffix('_moe').removesuffix('_dspark_muon')}: OK" in proc.stdout, log
    figures = results(proc.stdout)
    assert figures, log
    assert all(math.isfinite(v) for v in figures.values()), figures
    for key in positive:
        assert figures.get(key, 0) > 0, (key, figures)
    assert json.loads(out.read_text()), "empty JSON"


def test_moe_shapes_have_qwen3_30b_a3b_parameter_counts():
    """The MoE bench's MFU counts active parameters (plan.py's counts of the config it builds): at the
    Qwen3-30B-A3B shapes they must be the published 30.5B total / 3.3B activated (Qwen3 report)."""
    sys.path.insert(0, str(REPO))
    from bench import _common as C
    from dflash_train import plan

    shape = plan.target_shape(C.target_config(False, None, "qwen3-moe"))
    assert shape.total_params / 1e9 == pytest.approx(30.5, abs=0.05)
    assert shape.active_params / 1e9 == pytest.approx(3.3, abs=0.06)
    h = shape.hidden  # per layer: the router plus 8 of 128 experts' gate, up and down
    assert shape.active_mlp_params == h * 128 + 8 * 3 * h * 768
    dense = plan.target_shape(C.target_config(False))
    assert dense.active_mlp_params == 3 * 4096 * 12288
