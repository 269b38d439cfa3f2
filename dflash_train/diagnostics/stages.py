"""Doctor stages, child side: each runs in its own process, `python -m dflash_train.diagnostics.stages
KIND PARAMS_JSON RESULT_PATH`, and writes {status, figure, advice, data} to RESULT_PATH.

A child first arms `install_signal_stack_dump()` so the doctor can ask a stuck child for its stacks
(SIGUSR1) before killing it. torch is imported inside the stages that need it, never at module level,
so the cheap stages stay cheap and a broken torch install is reported by a stage, not a crash here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import traceback
from typing import Callable

from dflash_train.diagnostics.watchdog import install_signal_stack_dump

GiB = 2**30
SUPPORTED_TORCH = ((2, 11), (2, 14))  # inclusive minor-version range this project runs on


def result(status: str, figure: str, advice: str = "", **data) -> dict:
    """A stage outcome: status PASS|WARN|FAIL, the measured figure, what to do, extra data for later stages."""
    return {"status": status, "figure": figure, "advice": advice, "data": data}


def _version(*dists: str) -> str | None:
    """Installed version of the first distribution found, else None."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nvidia_driver() -> str | None:
    """Driver version from nvidia-smi where present (torch does not expose it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def stage_versions(params: dict) -> dict:
    """Versions of the stack, and where this torch keeps the FX-tracing flag."""
    import torch  # local: a broken torch is then this stage's FAIL (module doc)

    from dflash_train.diagnostics.compile_health import fx_tracing_flag_scope  # imports torch

    triton = _version("triton", "pytorch-triton")
    transformers = _version("transformers")
    scope = fx_tracing_flag_scope()
    figure = (f"python {platform.python_version()}, torch {torch.__version__}, triton {triton or '-'}, "
              f"transformers {transformers or '-'}, CUDA {torch.version.cuda or '-'}, "
              f"driver {_nvidia_driver() or '-'}; FX-tracing flag {scope}")
    minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if transformers is None:
        return result("FAIL", figure, "pip install 'transformers>=4.57'", fx_scope=scope)
    if torch.cuda.is_available() and triton is None:
        return result("FAIL", figure, "CUDA torch without triton: flex_attention cannot compile; pip install triton")
    if not SUPPORTED_TORCH[0] <= minor <= SUPPORTED_TORCH[1]:
        return result("WARN", figure, "untested torch: this project supports torch 2.11-2.14", fx_scope=scope)
    return result("PASS", figure, fx_scope=scope)


def _host_ram() -> tuple[float, float]:
    """(available, total) host RAM in GiB, from /proc/meminfo (sysconf elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"] / GiB, info["MemTotal"] / GiB
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page / GiB, os.sysconf("SC_PHYS_PAGES") * page / GiB


def stage_devices(params: dict) -> dict:
    """GPUs with free memory (mem_get_info), host RAM and CPU count."""
    import torch  # local: a broken torch is then this stage's FAIL (module doc)

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus, busy = [], []
    for i in range(n):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(f"cuda:{i} {torch.cuda.get_device_name(i)} {free / GiB:.1f}/{total / GiB:.1f} GiB free")
        if free < 0.8 * total:
            busy.append(f"cuda:{i}")
    ram_free, ram_total = _host_ram()
    figure = (f"{n} GPU{'s' if n != 1 else ''}{': ' if gpus else ''}{', '.join(gpus)}; host RAM "
              f"{ram_free:.1f}/{ram_total:.1f} GiB free, {os.cpu_count()} CPUs")
    if params.get("devices") == "cuda" and n == 0:
        return result("FAIL", figure, "no CUDA device visible: check the driver, CUDA_VISIBLE_DEVICES, and "
                      "that torch is a CUDA build", n_gpus=0)
    if busy:
        return result("WARN", figure, f"{', '.join(busy)} already >20% in use by another process: see nvidia-smi",
                      n_gpus=n)
    if ram_free < 4:
        return result("WARN", figure, "under 4 GiB host RAM free: target loading and data may swap", n_gpus=n)
    return result("PASS", figure, n_gpus=n)


def stage_disk(params: dict) -> dict:
    """Free disk where offline hidden-state shards would go."""
    path = os.path.abspath(params.get("dir") or os.getcwd())
    usage = shutil.disk_usage(path)
    free = usage.free / GiB
    figure = f"{free:.1f} GiB free of {usage.total / GiB:.1f} GiB at {path}"
    per_token = "offline shards take ~40 KB per token for an 8B target (5 taps x 4096 x bf16): 1M tokens = 41 GB"
    if free < 2:
        return result("FAIL", figure, f"free space or pass --disk-dir elsewhere; {per_token}")
    if free < 50:
        return result("WARN", figure, per_token)
    return result("PASS", figure)


def stage_compile(params: dict) -> dict:
    """Compile the training attention fwd(+bwd) on one device, then the train-time health check."""
    from dflash_train.diagnostics.attention_check import compile_check  # local: imports torch

    device, quick = params["device"], bool(params.get("quick"))
    compiled_mask = not (quick and device == "cpu")  # CPU trains with sdpa; --quick skips the slow builder
    r = compile_check(device, quick, compiled_mask)
    what = "fwd+bwd" if r["backward"] else "fwd (flex has no CPU backward)"
    # The first compiled call of each pays its compile (plus one-time inductor/triton start-up for
    # the first of the two), so together they are this process's time to a compiled step.
    builder = ("compiled, failed: " + r["mask_error"] + ", then uncompiled" if r["mask_error"] else
               "compiled" if r["mask_compiled"] else "uncompiled: --quick on CPU")
    figure = (f"{r['mask_s'] + r['compile_s']:.1f}s to a compiled step = mask builder ({builder}) "
              f"{r['mask_s']:.1f}s + attention {what} {r['compile_s']:.1f}s; {r['shape']}")
    if r["health_error"]:
        return result("FAIL", f"{figure}; {r['health_error'].splitlines()[-1][:300]}",
                      r["health_error"].replace("\n", " "), **r)
    figure += f"; healthy after warm-up: {r['health']}"
    if r["mask_error"] and device.startswith("cuda"):
        return result("FAIL", figure, "training on CUDA builds sliding-window masks with the compiled flex_block_mask: "
                      "fix dflash_train.model.drafter.attention.mask_rule for this torch", **r)
    if r["mask_error"]:
        return result("WARN", figure, "CPU training uses sdpa (dense mask), so only a GPU run needs the "
                      "compiled builder; check it there", **r)
    return result("PASS", figure, **r)


def stage_speed(params: dict) -> dict:
    """Compiled vs eager flex, fwd(+bwd): on an H200 eager is ~20x slower, so ~1x means no compile."""
    from dflash_train.diagnostics.attention_check import speed_check  # local: imports torch

    device, quick = params["device"], bool(params.get("quick"))
    r = speed_check(device, quick)
    what = "fwd+bwd" if r["backward"] else "fwd"
    figure = (f"compiled {r['compiled_ms']:.2f} ms vs eager {r['eager_ms']:.2f} ms per {what} "
              f"= {r['ratio']:.1f}x")
    if r["eager_peak_gib"] is not None:
        figure += f" (peak {r['compiled_peak_gib']:.2f} vs {r['eager_peak_gib']:.2f} GiB)"
    figure += f"; {r['shape']}"
    if device == "cpu":
        return result("PASS", figure, **r)  # CPU: report only, the GPU ratio is what matters
    if r["ratio"] < 2:
        return result("FAIL", figure, "compiled flex is no faster than eager: compile did not happen (eager "
                      "fallback); check TORCH_LOGS=recompiles and the 'flex_attention called without "
                      "torch.compile()' warning", **r)
    if r["ratio"] < 5:
        return result("WARN", figure, "expected ~20x on H200 at training shapes: check the kernel "
                      "(TORCH_LOGS=output_code) and GPU load", **r)
    return result("PASS", figure, **r)


def _free_port() -> int:
    """A free TCP port on localhost for the p2p rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_p2p(params: dict) -> dict:
    """send/recv of one taps-sized tensor between two processes: gloo on CPU, NCCL on two GPUs."""
    from dflash_train.diagnostics.p2p import run_pair, taps_bytes  # local: imports torch

    backend, quick = params["backend"], bool(params.get("quick"))
    nbytes, what = taps_bytes(backend, quick)
    iters = 5 if quick else 20
    r = run_pair(backend, nbytes, iters, _free_port())
    figure = (f"{backend} {r['route']}: {r['gb_per_s']:.2f} GB/s ({nbytes / 1e6:.1f} MB x {iters}, "
              f"{what}; {r['ms_per_send']:.2f} ms per send)")
    if backend == "nccl" and r["gb_per_s"] < 10:
        return result("WARN", figure, "slow GPU-to-GPU link: check `nvidia-smi topo -m` (NVLink/P2P), "
                      "NCCL_P2P_DISABLE, NCCL_DEBUG=INFO", **r)
    return result("PASS", figure, **r)


def stage_target(params: dict) -> dict:
    """Load the target and time a tapped forward (the online taps producer's work)."""
    from dflash_train.diagnostics.target_check import target_throughput  # local: imports torch

    try:  # local: imports torch; a broken or partial install is a FAIL that says so, not a crash
        from dflash_train.model.target.load import load_target
    except ImportError as e:
        return result("FAIL", f"cannot import dflash_train.model.target.load.load_target: {e}",
                      "this dflash-train install is incomplete or broken; reinstall the package")
    r = target_throughput(load_target, params["target"], params["device"], bool(params.get("quick")))
    figure = (f"{params['target']} on {params['device']}: {r['tokens_per_s']:,.0f} tokens/s tapped forward "
              f"({r['batch']}x{r['seq']} tokens, taps {r['layer_ids']}), {r['layers']} layers, hidden "
              f"{r['hidden']}, load {r['load_s']:.1f}s")
    return result("PASS", figure, **r)


STAGES: dict[str, Callable[[dict], dict]] = {
    "versions": stage_versions, "devices": stage_devices, "disk": stage_disk, "compile": stage_compile,
    "speed": stage_speed, "p2p": stage_p2p, "target": stage_target,
}


def _injected_hang() -> None:
    """A stage that never finishes (DFLASH_DOCTOR_INJECT=hang:<stage>): the doctor must report it."""
    while True:
        time.sleep(1)


def run_stage(kind: str, params: dict) -> dict:
    """Run one stage, turning an exception into a FAIL that names it (the traceback goes to stderr)."""
    inject = params.get("inject")
    if inject == "hang":
        _injected_hang()
    if inject == "fail":
        return result("FAIL", "injected failure (DFLASH_DOCTOR_INJECT)", "none: this failure was asked for")
    if inject == "crash":
        os._exit(7)
    try:
        return STAGES[kind](params)
    except Exception as e:  # noqa: BLE001 - any error is this stage's verdict
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return result("FAIL", f"{type(e).__name__}: {first}", "see the traceback below", show_log=True)


def main(argv: list[str]) -> int:
    """Child entry point: KIND PARAMS_JSON RESULT_PATH."""
    install_signal_stack_dump()
    kind, params, out = argv[0], json.loads(argv[1]), argv[2]
    outcome = run_stage(kind, params)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(outcome, f, default=str)
    os.replace(tmp, out)  # the doctor never reads a half-written result
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
