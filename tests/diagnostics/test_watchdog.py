"""The watchdog fires on a real stall with the stalled function's stack, and stays quiet while beaten."""

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dflash_train.diagnostics.watchdog import Watchdog

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

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


def test_watchdog_exits_with_last_stage_and_stack_on_a_stall(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    timeout = 2.0
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(timeout)], capture_output=True, text=True,
                          timeout=60, env=ENV)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert timeout <= elapsed < timeout + 10  # not early; within the timeout plus interpreter start and poll
    err = proc.stderr
    assert "WATCHDOG[stall-test pid=" in err and "no progress for 2" in err
    assert "last stage: 'step 4'" in err
    assert "stalled_in_the_data_loader" in err  # faulthandler and the named stacks both show it
    assert "--- thread MainThread" in err
    assert "never reached" not in proc.stdout


def test_watchdog_stays_quiet_while_beaten_then_names_the_stage():
    fired, out = [], io.StringIO()
    wd = Watchdog(0.6, name="unit", out=out, on_fire=fired.append).start()
    try:
        for i in range(12):  # 1.2 s of beats, twice the timeout
            wd.beat(f"step {i}")
            time.sleep(0.1)
        assert fired == []
        with wd.stage("held-out eval"):
            deadline = time.monotonic() + 5
            while not fired and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        wd.stop()
    assert len(fired) == 1
    assert "last stage: 'held-out eval' (entered" in fired[0]
    assert f"pid={os.getpid()}" in fired[0]
    assert "test_watchdog_stays_quiet_while_beaten_then_names_the_stage" in out.getvalue()


def test_stage_entry_time_is_kept_while_the_same_stage_beats():
    wd = Watchdog(60)
    wd.beat("waiting for taps")
    entered = wd._state[1]
    time.sleep(0.02)
    wd.beat("waiting for taps")
    assert wd._state[1] == entered and wd._state[2] > entered
    wd.beat("drafter step")
    assert wd._state[1] > entered


def test_sigusr1_prints_stacks_and_the_job_keeps_running(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(SIGNAL_DUMP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "ask_where_am_i" in proc.stderr
    assert "still running" in proc.stdout
