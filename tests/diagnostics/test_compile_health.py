"""compile_health against real torch.compile on CPU: healthy, recompiled, eager flex, stuck FX flag."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx._symbolic_trace as st
from torch.nn.attention.flex_attention import flex_attention

from dflash_train.diagnostics.compile_health import (
    CompileCounters,
    CompileHealthError,
    assert_compile_healthy,
    check_compile_health,
    freeze_compilation,
    fx_tracing_flag_scope,
    track_eager_flex_calls,
    warm_up_and_check,
)

REPO = Path(__file__).resolve().parents[2]


def _tiny(x):
    return torch.sin(x) * 2 + 1


@pytest.fixture(scope="module")
def tiny_compiled():
    return torch.compile(_tiny, dynamic=False)  # static: a new shape must recompile


def _qkv(length: int = 128):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, length, 16, generator=g) for _ in range(3)]


def test_healthy_after_warm_up(tiny_compiled):
    x = torch.randn(8)
    start = CompileCounters.snapshot()
    report = warm_up_and_check(lambda: tiny_compiled(x), n_warmup=2, n_check=3, expect_compiled_flex=True)
    assert report.ok, report.message()
    assert report.new_graphs == 0 and report.eager_flex_calls == 0 and not report.fx_flag_stuck
    assert CompileCounters.snapshot().unique_graphs - start.unique_graphs == 1  # warm-up did compile once
    torch.testing.assert_close(tiny_compiled(x), _tiny(x))


def test_a_recompile_after_the_snapshot_is_unhealthy(tiny_compiled):
    tiny_compiled(torch.randn(8))
    before = CompileCounters.snapshot()
    tiny_compiled(torch.randn(16))  # new shape, static compile: a second graph
    after = CompileCounters.snapshot()
    report = check_compile_health(before, after, expect_compiled_flex=False)
    assert not report.ok
    assert report.new_graphs == 1
    assert "recompile storm: 1 new graphs after warm-up" in report.message()
    assert "TORCH_LOGS=recompiles" in report.message()
    with pytest.raises(CompileHealthError, match="recompile storm") as err:
        assert_compile_healthy(before, after, expect_compiled_flex=False)
    assert err.value.report.new_graphs == 1
    assert check_compile_health(before, after, expect_compiled_flex=False, max_new_graphs=1).ok


def test_freeze_compilation_makes_a_recompile_raise(tiny_compiled):
    tiny_compiled(torch.randn(8))
    assert freeze_compilation()
    try:
        tiny_compiled(torch.randn(8))  # cached: fine
        with pytest.raises(RuntimeError, match="fail_on_recompile"):
            tiny_compiled(torch.randn(24))
    finally:
        torch.compiler.set_stance("default")


def test_uncompiled_flex_is_an_eager_fallback():
    assert track_eager_flex_calls()
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_attention(q, k, v)  # first eager call also compiles flex's eager HOP wrapper: not counted
        before = CompileCounters.snapshot()
        flex_attention(q, k, v)
        after = CompileCounters.snapshot()
    report = check_compile_health(before, after, expect_compiled_flex=True)
    assert report.eager_flex and report.eager_flex_calls == 1 and not report.ok
    assert report.message().count("flex_attention ran uncompiled (the dense path, ~20x slower on H200)") == 1
    assert report.new_graphs == 0  # the only problem is the fallback
    assert check_compile_health(before, after, expect_compiled_flex=False).ok  # not an error for sdpa/dense runs


EAGER_SCRIPT = textwrap.dedent("""
    import warnings, torch
    from torch.nn.attention.flex_attention import flex_attention
    from dflash_train.diagnostics.compile_health import CompileCounters, check_compile_health
    q = k = v = torch.randn(1, 2, 128, 16)
    before = CompileCounters.snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flex_attention(q, k, v)
    after = CompileCounters.snapshot()
    r = check_compile_health(before, after, expect_compiled_flex=True)
    print("RESULT", r.eager_flex, r.eager_flex_calls, before.eager_flex_warned, after.eager_flex_warned,
          any("without torch.compile" in str(w.message) for w in caught), flush=True)
""")


def test_eager_flex_is_seen_from_the_one_time_warning_alone(tmp_path):
    # A fresh process: the warning is once per process and no counting wrapper is installed.
    script = tmp_path / "eager.py"
    script.write_text(EAGER_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    assert line.split()[1:] == ["True", "0", "False", "True", "True"]


def _set_fx_flag(value: bool) -> None:
    if hasattr(st, "_set_is_fx_tracing"):  # 2.14+: thread-local
        st._set_is_fx_tracing(value)
    else:
        st._is_fx_tracing_flag = value


def test_a_stuck_fx_tracing_flag_is_reported():
    before = CompileCounters.snapshot()
    _set_fx_flag(True)
    try:
        after = CompileCounters.snapshot()
    finally:
        _set_fx_flag(False)
    report = check_compile_health(before, after, expect_compiled_flex=True)
    assert report.fx_flag_stuck and not report.ok
    assert "FX-tracing flag stuck at True" in report.message()
    assert "one process per GPU" in report.message()
    assert not CompileCounters.snapshot().fx_flag


def test_a_skipped_cuda_graph_fails_a_run_that_asked_for_graphs():
    """Inductor skips CUDA graphs for a graph on the CPU (a real skip, counted as on a GPU where an input or op
    keeps a graph out): unhealthy when the run asked for graphs, ignored when it did not."""
    before = CompileCounters.snapshot()
    torch.compile(_tiny, dynamic=False, mode="reduce-overhead")(torch.ones(5))
    after = CompileCounters.snapshot()
    assert after.cudagraph_skips > before.cudagraph_skips
    asked = check_compile_health(before, after, expect_compiled_flex=False, max_new_graphs=1, expect_graphs=True)
    assert not asked.ok and "CUDA graphs skipped" in asked.message() and "train.compile_mode=default" in asked.message()
    assert check_compile_health(before, after, expect_compiled_flex=False, max_new_graphs=1).ok


def test_fx_flag_scope_matches_this_torch():
    minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert fx_tracing_flag_scope() == ("per-thread" if minor >= (2, 14) else "process-wide")


def test_compile_seconds_split_a_real_compile_by_phase():
    """A real compile on the CPU: its seconds by phase from Dynamo's timers, the parts within the whole; a call that
    compiles nothing adds nothing."""
    from dflash_train.diagnostics.compile_health import CompileSeconds

    torch._dynamo.reset()
    before = CompileSeconds.snapshot()
    f = torch.compile(lambda x: (x.sin() * 2).sum())
    f(torch.randn(8))
    spent = CompileSeconds.snapshot() - before
    assert spent.compiling > 0 and 0 < spent.tracing <= spent.compiling and 0 < spent.backend <= spent.compiling
    assert spent.loading <= spent.backend
    again = CompileSeconds.snapshot()
    f(torch.randn(8))
    assert CompileSeconds.snapshot() - again == CompileSeconds()
    assert spent.summary().startswith("torch.compile ") and "tracing" in spent.summary()
