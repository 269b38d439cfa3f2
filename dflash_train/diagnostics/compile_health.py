"""Is torch.compile really doing its job? The check `train` runs after warm-up and `doctor` runs too.

The failure this guards against (docs: shared/docs/compile-race.md) is silent: compiled flex_attention
falls back to its uncompiled path (a dense B x H x Q x KV score matrix, ~20x slower and ~45x the
memory on an H200) after a recompile storm hits `recompile_limit`, or because the FX-tracing flag was
left stuck by threads; nothing crashes, the run just gets slow. So we read the signals torch leaves:

- `torch._dynamo.utils.counters`: `stats.unique_graphs` (one per compiled graph: a growth after
  warm-up is a recompile), `frames`, `graph_break`, `unimplemented` (where "recompile limit" hits are
  recorded), `aot_autograd`; names checked on 2.11 and 2.13, every read is defensive;
- the eager-flex signal: flex_attention's uncompiled path calls `_warn_once("flex_attention_
  performance", ...)` on every call (2.9+; the warning itself shows once per process), so we count
  those calls with a thin wrapper and also read `_WARNINGS_SHOWN`;
- the FX-tracing flag, `torch.fx._symbolic_trace._is_fx_tracing_flag` (process-wide, <= 2.13) or
  `_get_is_fx_tracing()` (per thread, 2.14+): True while nothing compiles means it is stuck.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx._symbolic_trace as fx_trace

EAGER_FLEX_WARNING_ID = "flex_attention_performance"
_RECOMPILE_LIMIT_MARKERS = ("recompile limit", "recompile_limit", "cache_size_limit")

_eager_flex_lock = threading.Lock()
_eager_flex_calls = 0  # uncompiled flex_attention calls seen since `track_eager_flex_calls()`


class CompileHealthError(RuntimeError):
    """Compilation is not healthy; `.report` holds the measured `HealthReport`."""

    def __init__(self, report: "HealthReport"):
        super().__init__(report.message())
        self.report = report


def _flex_module():
    """`torch.nn.attention.flex_attention`, or None on a torch without it."""
    try:
        import torch.nn.attention.flex_attention as fa  # local and guarded: absent means unsupported
    except ImportError:
        return None
    return fa


def track_eager_flex_calls() -> bool:
    """Count every uncompiled flex_attention call from now on (idempotent; False if unsupported).

    Why a wrapper: the performance warning shows once per process, so after the first eager call
    `_WARNINGS_SHOWN` can no longer tell "again after warm-up" apart. The uncompiled path calls
    `_warn_once` with the same id on every call (the compiled path returns before it), so counting
    those calls counts eager flex calls. The wrapper only counts and then defers to torch.
    """
    fa = _flex_module()
    original = getattr(fa, "_warn_once", None)
    if original is None:
        return False
    if getattr(original, "_dflash_counting", False):
        return True

    def counting_warn_once(warning_id: str, *args, **kwargs):
        global _eager_flex_calls
        if warning_id == EAGER_FLEX_WARNING_ID:
            with _eager_flex_lock:
                _eager_flex_calls += 1
        return original(warning_id, *args, **kwargs)

    counting_warn_once._dflash_counting = True  # type: ignore[attr-defined]
    fa._warn_once = counting_warn_once
    return True


def fx_tracing_flag() -> bool:
    """The FX-tracing flag as the calling thread sees it (what Dynamo's wrapper checks)."""
    getter = getattr(fx_trace, "_get_is_fx_tracing", None)  # 2.14+: thread-local
    if getter is not None:
        return bool(getter())
    if hasattr(fx_trace, "_is_fx_tracing_flag"):  # <= 2.13: module global
        return bool(fx_trace._is_fx_tracing_flag)
    return bool(getattr(fx_trace, "is_fx_tracing", lambda: False)())


def fx_tracing_flag_scope() -> str:
    """"per-thread" where torch keeps the FX-tracing flag thread-local (2.14+), else "process-wide".

    Decided by introspection (the TLS object or its getter), not the version string, so a backport
    or a nightly is judged by what it does.
    """
    if hasattr(fx_trace, "_is_fx_tracing_tls") or hasattr(fx_trace, "_get_is_fx_tracing"):
        return "per-thread"
    return "process-wide"


def _counter(group: str, key: str | None = None) -> int:
    """One counter, 0 when absent; `key=None` sums the group. Never creates keys (defaultdict)."""
    try:
        from torch._dynamo.utils import counters  # local: torch loads _dynamo lazily (slow)
    except ImportError:
        return 0
    values = counters.get(group) or {}
    if key is None:
        return int(sum(v for v in values.values() if isinstance(v, (int, float))))
    return int(values.get(key, 0) or 0)


def _recompile_limit_hits() -> int:
    """Graph-break records whose message names the recompile limit (then Dynamo runs eager)."""
    from torch._dynamo.utils import counters  # local: torch loads _dynamo lazily (slow)

    hits = 0
    for group in ("unimplemented", "graph_break", "recompile_limit"):
        for msg, n in (counters.get(group) or {}).items():
            if group == "recompile_limit" or any(m in str(msg).lower() for m in _RECOMPILE_LIMIT_MARKERS):
                hits += int(n)
    return hits


@dataclass(frozen=True)
class CompileCounters:
    """Process-wide compile counters at one instant; compare two with `check_compile_health`."""

    unique_graphs: int = 0
    frames_total: int = 0
    frames_ok: int = 0
    recompiles: int = 0  # `counters["recompiles"]` where a torch version keeps one (sum)
    graph_breaks: int = 0
    recompile_limit_hits: int = 0
    aot_autograd_total: int = 0
    inductor_events: int = 0
    eager_flex_calls: int = 0  # counted only after `track_eager_flex_calls()`
    eager_flex_warned: bool = False
    flex_debug_eager: bool = False  # _FLEX_ATTENTION_DISABLE_COMPILE_DEBUG: flex forced eager
    fx_flag: bool = False
    compiling: bool = False  # torch.compiler.is_compiling() at snapshot time (2.13+ leaks it)
    cudagraph_skips: int = 0  # inductor's count of graphs run without CUDA graphs (or re-recorded past its limit)

    @classmethod
    def snapshot(cls) -> "CompileCounters":
        """Read the counters now (cheap: dictionary reads, no sync, no side effects)."""
        fa = _flex_module()
        shown = getattr(fa, "_WARNINGS_SHOWN", None) or set()
        is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
        return cls(
            unique_graphs=_counter("stats", "unique_graphs"),
            frames_total=_counter("frames", "total"),
            frames_ok=_counter("frames", "ok"),
            recompiles=_counter("recompiles"),
            graph_breaks=_counter("graph_break"),
            recompile_limit_hits=_recompile_limit_hits(),
            aot_autograd_total=_counter("aot_autograd", "total"),
            inductor_events=_counter("inductor"),
            eager_flex_calls=_eager_flex_calls,
            eager_flex_warned=EAGER_FLEX_WARNING_ID in shown,
            flex_debug_eager=bool(getattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False)),
            fx_flag=fx_tracing_flag(),
            compiling=bool(is_compiling()),
            cudagraph_skips=_counter("inductor", "cudagraph_skips"),
        )

    def as_dict(self) -> dict:
        """Plain dict (for JSON)."""
        return dataclasses.asdict(self)


@dataclass
class HealthReport:
    """What changed between two snapshots, and whether that is healthy."""

    new_graphs: int
    new_frames: int
    new_recompiles: int
    new_graph_breaks: int
    new_recompile_limit_hits: int
    eager_flex_calls: int
    eager_flex: bool
    fx_flag_stuck: bool
    fx_flag_scope: str
    expect_compiled_flex: bool
    max_new_graphs: int
    cudagraph_skips: int = 0  # since the process started: a graph skipped at its first compile never runs as one
    expect_graphs: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def message(self) -> str:
        """One paragraph per problem, or a one-line summary when healthy."""
        if self.ok:
            return self.summary()
        return "compile health check failed:\n- " + "\n- ".join(self.problems)

    def summary(self) -> str:
        """The measured figures on one line."""
        return (f"{self.new_graphs} new graphs, {self.new_recompile_limit_hits} recompile-limit hits, "
                f"{self.new_graph_breaks} graph breaks, {self.eager_flex_calls} eager flex calls, "
                f"FX flag {'stuck' if self.fx_flag_stuck else 'clear'} ({self.fx_flag_scope})"
                f"{f', {self.cudagraph_skips} CUDA-graph skips' if self.expect_graphs else ''}")


def _eager_flex_problem(n_calls: int, debug_flag: bool) -> str:
    """The eager-fallback message: what ran, the usual causes, the fix."""
    cause = ("torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is True"
             if debug_flag else f"{n_calls or 'some'} uncompiled flex_attention call(s) after warm-up")
    return ("flex_attention ran uncompiled (the dense path, ~20x slower on H200): " + cause +
            ". Causes: flex called outside the compiled step, the recompile limit was hit "
            "(log: 'hit config.recompile_limit'; TORCH_LOGS=recompiles), or a stuck FX-tracing flag "
            "with error_on_nested_fx_trace=False. Fix: call flex only inside the torch.compile'd step, "
            "static shapes, one process per GPU.")


def _problems(after: CompileCounters, report: HealthReport) -> list[str]:
    """The human-readable causes, each naming the fix."""
    problems = []
    if report.expect_compiled_flex and report.eager_flex:
        problems.append(_eager_flex_problem(report.eager_flex_calls, after.flex_debug_eager))
    if report.new_graphs > report.max_new_graphs or report.new_recompiles > 0:
        n = max(report.new_graphs, report.new_recompiles)
        problems.append(f"recompile storm: {n} new graphs after warm-up (allowed {report.max_new_graphs}); "
                        "shapes not static? see TORCH_LOGS=recompiles (pad to fixed shapes or warm up "
                        "every shape, then freeze_compilation())")
    if report.new_recompile_limit_hits:
        problems.append(f"recompile limit hit {report.new_recompile_limit_hits}x after warm-up: Dynamo now "
                        "runs those frames uncompiled; see TORCH_LOGS=recompiles")
    if report.fx_flag_stuck:
        problems.append(
            "FX-tracing flag stuck at True while nothing compiles (torch.fx._symbolic_trace, "
            f"{report.fx_flag_scope}): every later compiled call raises 'Detected that you are using FX "
            "to symbolically trace a dynamo-optimized function' or runs uncompiled. Cause: uncompiled "
            "flex_attention/create_block_mask/cond in one thread while another compiled. Fix: one "
            "process per GPU (never compile in threads); restart this process.")
    if report.expect_graphs and report.cudagraph_skips:
        problems.append(f"CUDA graphs skipped {report.cudagraph_skips}x (train.compile_mode=reduce-overhead): those "
                        "graphs run their kernels one by one, or were re-recorded past inductor's limit; the reason is "
                        "in the log's 'skipping cudagraphs' line (TORCH_LOGS=cudagraphs). Fix the cause or use "
                        "train.compile_mode=default")
    return problems


def check_compile_health(before: CompileCounters, after: CompileCounters, *, expect_compiled_flex: bool,
                         max_new_graphs: int = 0, expect_graphs: bool = False) -> HealthReport:
    """Compare two snapshots taken around steps that should not compile anything new.

    `expect_compiled_flex`: the steps use flex_attention inside torch.compile, so any eager flex call
    is a fallback. `max_new_graphs`: graphs allowed to appear between the snapshots (0 after warm-up).
    `expect_graphs`: the step runs as CUDA graphs, so any skip since the process started is a fallback.
    """
    eager_calls = max(0, after.eager_flex_calls - before.eager_flex_calls)
    eager = (eager_calls > 0 or (after.eager_flex_warned and not before.eager_flex_warned)
             or after.flex_debug_eager)
    report = HealthReport(
        new_graphs=after.unique_graphs - before.unique_graphs,
        new_frames=after.frames_total - before.frames_total,
        new_recompiles=after.recompiles - before.recompiles,
        new_graph_breaks=after.graph_breaks - before.graph_breaks,
        new_recompile_limit_hits=after.recompile_limit_hits - before.recompile_limit_hits,
        eager_flex_calls=eager_calls,
        eager_flex=eager,
        fx_flag_stuck=after.fx_flag and not after.compiling,
        fx_flag_scope=fx_tracing_flag_scope(),
        expect_compiled_flex=expect_compiled_flex,
        max_new_graphs=max_new_graphs,
        cudagraph_skips=after.cudagraph_skips,
        expect_graphs=expect_graphs,
    )
    report.problems = _problems(after, report)
    return report


def assert_compile_healthy(before: CompileCounters, after: CompileCounters, *, expect_compiled_flex: bool,
                           max_new_graphs: int = 0, expect_graphs: bool = False) -> HealthReport:
    """`check_compile_health`, raising `CompileHealthError` (cause and fix in the message) if not ok."""
    report = check_compile_health(before, after, expect_compiled_flex=expect_compiled_flex,
                                  max_new_graphs=max_new_graphs, expect_graphs=expect_graphs)
    if not report.ok:
        raise CompileHealthError(report)
    return report


def freeze_compilation() -> bool:
    """Make any later (re)compile raise instead of silently compiling or falling back to eager.

    `torch.compiler.set_stance("fail_on_recompile")` is process-global. Returns False (and changes
    nothing) on a torch without it. Undo with `torch.compiler.set_stance("default")`.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return False
    try:
        set_stance("fail_on_recompile")
    except (ValueError, RuntimeError, TypeError):  # a stance name this torch does not know
        return False
    return True


def warm_up_and_check(step_fn: Callable[[], object], n_warmup: int, n_check: int,
                      expect_compiled_flex: bool, max_new_graphs: int = 0) -> HealthReport:
    """Run `step_fn` (one fwd+bwd) `n_warmup` times, snapshot, `n_check` more times, assert health.

    Raises `CompileHealthError` naming the cause and the fix. Eager flex calls are tracked from the
    start, so a fallback is seen even if its one-time warning already fired earlier in the process.
    """
    track_eager_flex_calls()
    for _ in range(n_warmup):
        step_fn()
    before = CompileCounters.snapshot()
    for _ in range(n_check):
        step_fn()
    after = CompileCounters.snapshot()
    return assert_compile_healthy(before, after, expect_compiled_flex=expect_compiled_flex,
                                  max_new_graphs=max_new_graphs)


@dataclass(frozen=True)
class GraphCacheCounts:
    """Inductor's on-disk cache lookups so far in this process: the FX-graph cache (one lookup per compiled graph,
    forward and backward apart) and the AOT-autograd cache (one per compiled function). A hit loads a graph that
    another process (the compile prewarm, train.compile_prewarm) or an earlier run compiled; a miss compiles it
    here. Counter names as in torch 2.13 (`counters["inductor"]["fxgraph_cache_hit"]`, ...); absent ones read 0."""

    fx_hits: int = 0
    fx_misses: int = 0
    fx_bypasses: int = 0  # graphs inductor would not cache (then compiled each time)
    aot_hits: int = 0
    aot_misses: int = 0

    @classmethod
    def snapshot(cls) -> "GraphCacheCounts":
        return cls(_counter("inductor", "fxgraph_cache_hit"), _counter("inductor", "fxgraph_cache_miss"),
                   _counter("inductor", "fxgraph_cache_bypass"), _counter("aot_autograd", "autograd_cache_hit"),
                   _counter("aot_autograd", "autograd_cache_miss"))

    def __sub__(self, other: "GraphCacheCounts") -> "GraphCacheCounts":
        return GraphCacheCounts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    @property
    def graphs(self) -> int:
        return self.fx_hits + self.fx_misses + self.fx_bypasses

    def summary(self) -> str:
        """'5 of 5 graphs from inductor's cache (0 compiled here), AOT autograd 2 hits / 0 misses'."""
        bypassed = f", {self.fx_bypasses} not cacheable" if self.fx_bypasses else ""
        return (f"{self.fx_hits} of {self.graphs} graphs from inductor's FX-graph cache ({self.fx_misses} compiled "
                f"here{bypassed}), AOT autograd cache {self.aot_hits} hits / {self.aot_misses} misses")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Dynamo's own timers (`torch._dynamo.utils.compilation_time_metrics`: name -> seconds of each call), as in torch 2.13
_PHASE_TIMERS = {"compiling": "_compile.compile_inner", "tracing": "bytecode_tracing",
                 "backend": "OutputGraph.call_user_compiler", "loading": "PyCodeCache.load_by_key_path"}


@dataclass(frozen=True)
class CompileSeconds:
    """Seconds torch.compile spent so far in this process, by phase, from Dynamo's own timers (absent ones read 0):
    all of it (`compiling`: tracing + backend), Dynamo's bytecode tracing (never cached: each process traces its
    graphs again), the backend (AOT autograd and inductor, their cache lookups included) and, inside the backend, the
    loading of compiled modules from inductor's code cache (their kernels). A first step that found every graph in
    the cache and still took seconds says here where they went (session 28: 8-11 s on an H200)."""

    compiling: float = 0.0
    tracing: float = 0.0
    backend: float = 0.0
    loading: float = 0.0

    @classmethod
    def snapshot(cls) -> "CompileSeconds":
        try:
            from torch._dynamo.utils import compilation_time_metrics as metrics  # local, as in _counter
        except ImportError:
            metrics = {}
        return cls(*(float(sum(metrics.get(name, ()))) for name in _PHASE_TIMERS.values()))

    def __sub__(self, other: "CompileSeconds") -> "CompileSeconds":
        return CompileSeconds(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def summary(self) -> str:
        """'torch.compile 2.9 s of it: tracing 1.0 s, backend 1.8 s (loading compiled modules 1.6 s)'."""
        return (f"torch.compile {self.compiling:.1f} s of it: tracing {self.tracing:.1f} s, "
                f"backend {self.backend:.1f} s (loading compiled modules {self.loading:.1f} s)")
