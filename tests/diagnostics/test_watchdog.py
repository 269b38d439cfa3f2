"""The watchdog fires on a real stall with the stalled function's stack, and stays quiet while beaten."""

import io
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from dflash_train.diagnostics import watchdog as watchdog_mod
from dflash_train.diagnostics.watchdog import Watchdog

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
SAFETY_S = 60  # a bound on waiting only: past it the test fails; no test asserts a duration

STALL = textwrap.dedent("""
    import sys, time
    from dflash_train.diagnostics.watchdog import Watchdog

    wd = Watchdog(float(sys.argv[1]), name="stall-test").start()
    for i in range(5):
        wd.beat(f"step {i}")
        time.sleep(0.05)

    def stalled_in_the_data_loader():
        time.sleep(120)

    stalled_in_the_data_loader()
    print("never reached", flush=True)
""")

SIGNAL_DUMP = textwrap.dedent("""
    import os, signal
    from dflash_train.diagnostics.watchdog import install_signal_stack_dump

    assert install_signal_stack_dump()

    def ask_where_am_i():
        os.kill(os.getpid(), signal.SIGUSR1)

    ask_where_am_i()
    print("still running", flush=True)
""")


class FakeClock:
    """The watchdog module's `time`: `monotonic()` returns what the test sets. Each read from the
    watchdog thread counts as one poll, so the test waits for a poll instead of sleeping."""

    def __init__(self):
        self.now = 100.0
        self._polls = threading.Semaphore(0)

    def monotonic(self) -> float:
        if threading.current_thread().name.startswith("watchdog-"):
            self._polls.release()
        return self.now

    def wait_for_poll(self) -> None:
        assert self._polls.acquire(timeout=SAFETY_S), "the watchdog thread stopped polling"

    def skip_polls_so_far(self) -> None:
        while self._polls.acquire(blocking=False):
            pass


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(watchdog_mod, "time", fake)
    return fake


def test_watchdog_exits_with_last_stage_and_stack_on_a_stall(tmp_path):
    """A real process stalls after five beats: the watchdog names the last stage, dumps the
    stalled function's stack and exits with its code; the stall's code after is never reached."""
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    timeout = 2.0
    proc = subprocess.run([sys.executable, str(script), str(timeout)], capture_output=True, text=True,
                          timeout=SAFETY_S, env=ENV)
    assert proc.returncode == 3, proc.stderr[-2000:]
    err = proc.stderr
    fired = re.search(r"WATCHDOG\[stall-test pid=\d+\]: no progress for ([\d.]+)s; last stage: 'step 4'", err)
    assert fired, err[-2000:]
    assert float(fired[1]) >= timeout  # it fired on the timeout, not before it
    assert "stalled_in_the_data_loader" in err  # faulthandler and the named stacks both show it
    assert "--- thread MainThread" in err
    assert err.index("no progress for") < err.index("stalled_in_the_data_loader") < err.index("exiting with code 3")
    assert "never reached" not in proc.stdout


def test_watchdog_stays_quiet_while_beaten_then_names_the_stage(clock):
    """On a test clock: beats just inside the timeout never fire, through many polls and ten
    timeouts' worth of time; one idle stretch past it fires once, naming the stage."""
    fired, out = [], io.StringIO()
    wd = Watchdog(0.4, name="unit", out=out, on_fire=fired.append).start()  # polls every 0.1 s of real time
    try:
        for i in range(10):
            clock.now += 0.39  # idle just under the timeout ...
            clock.skip_polls_so_far()
            clock.wait_for_poll()  # ... and the watchdog has looked at it
            wd.beat(f"step {i}")
        assert fired == [] and not wd.fired
        with wd.stage("held-out eval"):
            clock.now += 0.5
            clock.skip_polls_so_far()
            clock.wait_for_poll()
            wd._thread.join(timeout=SAFETY_S)  # having fired, the watchdog thread ends
    finally:
        wd.stop()
    assert fired == [f"WATCHDOG[unit pid={os.getpid()}]: no progress for 0.5s; last stage: 'held-out eval' "
                     "(entered 0.5s ago)"]
    assert "test_watchdog_stays_quiet_while_beaten_then_names_the_stage" in out.getvalue()


def test_stage_entry_time_is_kept_while_the_same_stage_beats(clock):
    wd = Watchdog(60)
    wd.beat("waiting for taps")
    clock.now += 1.0
    wd.beat("waiting for taps")
    assert wd._state == ("waiting for taps", 100.0, 101.0)
    clock.now += 1.0
    wd.beat("drafter step")
    assert wd._state == ("drafter step", 102.0, 102.0)


def test_sigusr1_prints_stacks_and_the_job_keeps_running(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(SIGNAL_DUMP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=SAFETY_S,
                          env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "ask_where_am_i" in proc.stderr
    assert "still running" in proc.stdout
