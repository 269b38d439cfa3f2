"""Compile-health checks and kernel profiles of the bench scripts (split from bench/_common.py,
which re-exports them)."""

from __future__ import annotations

import torch

from bench._bench import Bench, sync

# ------------------------------------------------------------------------------------------------
# Compile health: `dflash_train.diagnostics.compile_health` when present (imported defensively; its
# API is snapshot -> steps -> snapshot -> assert_compile_healthy), else dynamo's counters only.


def compile_health_module():
    try:
        from dflash_train.diagnostics import compile_health
    except Exception:  # noqa: BLE001 - absent or broken: fall back to the counters
        return None
    return compile_health


def call_quietly(fn, *args, **kwargs):
    if fn is None:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return None


def health_snapshot(module):
    snap = getattr(getattr(module, "CompileCounters", None), "snapshot", None)
    return call_quietly(snap)


def check_compile_health(bench: Bench, module, st: dict, expect_compiled_flex: bool) -> None:
    """Compare the counters around the timed steps (nothing may compile there); raise if unhealthy.

    Figures: graphs compiled by the end of warm-up, graph breaks, graphs added during timing."""
    before, after = st.get("counters_before", {}), st.get("counters_after", {})
    bench.figure("compiled_graphs_after_warmup", before.get("unique_graphs", -1))
    bench.figure("graph_breaks", after.get("graph_breaks", -1))
    new_graphs = after.get("unique_graphs", 0) - before.get("unique_graphs", 0)
    bench.figure("recompiles_during_timing", new_graphs)
    check = getattr(module, "assert_compile_healthy", None)
    h_before, h_after = st.get("health_before"), st.get("health_after")
    if check is None or h_before is None or h_after is None:
        bench.info["compile_health"] = "diagnostics.compile_health unavailable: dynamo counters only"
        bench.log("compile health: dflash_train.diagnostics.compile_health not usable here; counters only")
        if new_graphs > 0:
            raise RuntimeError(f"{new_graphs} graph(s) compiled during the timed steps (recompiles)")
        return
    report = check(h_before, h_after, expect_compiled_flex=expect_compiled_flex)
    summary = getattr(report, "summary", lambda: repr(report))()
    bench.info["compile_health"] = f"ok: {summary}"
    bench.log(f"compile health OK: {summary}")


KERNEL_GROUPS = (  # (group, substrings of a kernel or op name), first match wins
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_xmma", "aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("flex", "attention", "flash")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lerp")),  # lerp: the compiled AdamW update
    ("loss softmax", ("log_softmax", "softmax")),
    ("mask builder", ("block_mask", "create_block")),
    ("copies", ("copy", "memcpy", "memset", "fill")),
    ("fused elementwise/reductions", ("triton_", "fused", "elementwise", "reduce")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def profile_steps(bench: Bench, step, steps: int, device: torch.device, rows: int = 25) -> None:
    """Run `steps` steps under torch.profiler; print the top kernels and the time per kernel group
    (device time on CUDA, CPU time otherwise), as figures `profile_<group>_ms` per step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    events = prof.key_averages()
    on_device = device.type == "cuda"
    key = "self_device_time_total" if on_device else "self_cpu_time_total"

    def self_us(e) -> float:
        return float(getattr(e, key, 0.0) or getattr(e, key.replace("device", "cuda"), 0.0) or 0.0)

    # "#" marks user annotations (Optimizer.step#AdamW.step, ## Call CompiledFxGraph ##): ranges on
    # the device timeline that overlap the kernels inside them, so counting them would count twice
    kernels = [e for e in events if self_us(e) > 0 and "#" not in e.key
               and (not on_device or e.device_type.name == "CUDA")]
    kernels.sort(key=self_us, reverse=True)
    total = sum(self_us(e) for e in kernels) or 1.0
    bench.log(f"profile over {steps} steps: {total / 1e3 / steps:.1f} ms of {'device' if on_device else 'CPU'} "
              f"time per step; top kernels (ms per step, share, calls per step):")
    for e in kernels[:rows]:
        bench.log(f"  {self_us(e) / 1e3 / steps:8.2f} ms {100 * self_us(e) / total:5.1f}% "
                  f"{e.count / steps:6.1f}x  [{kernel_group(e.key)}] {e.key[:110]}")
    if on_device:
        _log_host_side(bench, events, steps)
    groups: dict[str, float] = {}
    for e in kernels:
        groups[kernel_group(e.key)] = groups.get(kernel_group(e.key), 0.0) + self_us(e)
    for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        bench.figure(f"profile_{group.split()[0].split('/')[0]}_ms", us / 1e3 / steps, f"{100 * us / total:.1f}%")
    bench.figure("profile_device_ms", total / 1e3 / steps, "kernels only; the step time minus this is idle time")


HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
              "cudaMemcpy ", "cudaMemcpyAsync", "cudaHostAlloc")


def _log_host_side(bench: Bench, events, steps: int, rows: int = 12) -> None:
    """The host side of a profiled CUDA step: calls that can stall the host on the GPU (syncs,
    .item(), copies), then the ops that take the most host time."""
    for e in events:
        if any(e.key.startswith(k.strip()) for k in HOST_SYNCS):
            bench.log(f"  host: {e.key[:60]} x{e.count / steps:.1f}/step, {e.self_cpu_time_total / 1e3 / steps:.2f} ms/step")
    host = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    bench.log(f"host time per step {sum(e.self_cpu_time_total for e in host) / 1e3 / steps:.1f} ms; top ops:")
    for e in host[:rows]:
        bench.log(f"  host {e.self_cpu_time_total / 1e3 / steps:7.2f} ms x{e.count / steps:6.1f}  {e.key[:100]}")
