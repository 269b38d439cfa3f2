"""Stopping a job of any layout (train/watch/stop.py).

The vote itself, in real gloo worlds of processes: a request on any rank stops every rank after
the same step, however far ahead some rank runs; a rank that dies makes the others fail at once.
Then whole training jobs (torchrun, the tiny target, 1 target + 2 drafter ranks): SIGTERM to the
launcher (issue 32, defect 1: the target ranks left at once and the drafters failed with
`Connection closed by peer`, 3 steps lost) and SIGTERM to one non-main drafter rank (defect 5: the
job stalled until the watchdog, and the main rank blamed the time budget) both end with one
INTERRUPTED verdict naming the step, whose checkpoint is written, and resume to the uninterrupted
run's weights; a rank frozen by SIGSTOP is named by the others. A SIGKILLed rank named by the
others: tests/train/test_chaos.py, on the same reference run."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dflash_train.train.watch.stop import StopFlag, StopVote
from dflash_train.train.parallel.topology import Topology

STEPS = 30


def _rank(rank: int, world: int, init: str, out: str, request_at: dict, ahead: int, die_at: dict) -> None:
    """Rank 0 plays a target rank that runs ahead (no pause), the others drafter ranks; each walks
    the protocol as loop.py does and records the step it stopped after."""
    import faulthandler

    faulthandler.dump_traceback_later(60, exit=True)  # a hang shows its stack, and the test fails
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    topo = Topology("disaggregated", world, rank, rank, num_target_ranks=1)
    vote = StopVote.for_topology(topo, dist.new_group(backend="gloo"), max_in_flight=ahead)
    step = 0
    try:
        while step < STEPS and not vote.stops_after(step):
            step += 1
            vote.before_step(step)
            if rank and step > ahead:
                time.sleep(0.02 * rank)  # drafters are slower: rank 0 runs up to `slack` steps ahead
            if die_at.get(rank) == step:
                os._exit(9)
            vote.after_step(step, 1 if request_at.get(rank) == step else 0)
        vote.finish()
        record = {"stopped_after": step, "stop_step": vote.stop_step, "cause": vote.cause(topo.role)}
    except RuntimeError as e:
        Path(out, f"{rank}.txt").write_text(repr({"error": str(e)[:200], "at": step}))
        os._exit(1)  # as cli.py ends a failed rank: a process group with a dead member is not torn down
    Path(out, f"{rank}.txt").write_text(repr(record))
    dist.destroy_process_group()


def _world(tmp_path, world=3, request_at=None, die_at=None, ahead=2) -> dict:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, f"file://{tmp_path}/pg", str(tmp_path), request_at or {},
                                             ahead, die_at or {})) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung")
    return {r: eval(Path(tmp_path, f"{r}.txt").read_text()) for r in range(world)
            if Path(tmp_path, f"{r}.txt").exists()}


def test_a_request_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    got = _world(tmp_path, request_at={2: 5})
    slack = 2
    want = 5 + slack + 2  # posted after step 5, learned before step 5 + slack + 1, receives one step ahead
    assert {r["stopped_after"] for r in got.values()} == {want}, got
    assert all(r["cause"] == "SIGTERM on rank 2 (drafter)" for r in got.values())


def test_without_a_request_every_rank_reaches_the_end(tmp_path):
    got = _world(tmp_path)
    assert all(r == {"stopped_after": STEPS, "stop_step": None, "cause": ""} for r in got.values()), got


def test_a_rank_that_dies_fails_the_others_instead_of_hanging(tmp_path):
    got = _world(tmp_path, die_at={1: 6})
    assert set(got) == {0, 2} and all("error" in r for r in got.values()), got


def test_one_request_delivered_twice_is_one_and_a_later_signal_stops_at_once(capsys):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        flag = StopFlag()
        flag.deferring = True
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's forward of the same request: ignored
        assert flag.signal == "SIGTERM" and capsys.readouterr().out.count("SIGTERM:") == 1
        flag.at -= 10  # long after: the user means it
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_signal_delivered_twice_outside_the_loop_stops_once(capsys):
    """Seen on README command 1 stopped by `timeout`: the second SIGTERM raised out of the first's cleanup."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        flag = StopFlag()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM during setup"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGTERM)  # while the first one unwinds: ignored
        time.sleep(0.1)
        assert capsys.readouterr().out.count("SIGTERM: stopping now") == 1
        flag.at -= 10  # long after: stops at once again
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


# --- whole jobs: 1 target + 2 drafter ranks (tests/train/conftest.py's reference run), SIGTERM to
# the launcher or to one drafter, SIGSTOP to one drafter

pytest.importorskip("bench.chaos")


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_the_agreed_step_and_resumes_to_the_same_weights(
        disaggregated_reference, tmp_path, capsys):
    from bench.chaos import Fault, fault_and_resume

    layout, weights = disaggregated_reference
    fault = Fault(signal.SIGTERM, "launcher", at_step=3)
    problems = fault_and_resume("trial", tmp_path / "run", layout, fault, weights)
    out = capsys.readouterr().out
    assert problems == [], "\n".join(problems) + out[-3000:]
    assert "RESULT trial_lost_steps=0" in out and "RESULT trial_bit_exact=True" in out
    log = (tmp_path / "run.log").read_text()
    assert "INTERRUPTED after step" in log and "(SIGTERM on " in log and "WATCHDOG" not in log


@pytest.mark.slow
def test_sigterm_to_one_drafter_rank_stops_every_rank_after_one_checkpointed_step(disaggregated_reference, tmp_path,
                                                                                   capsys):
    from bench.chaos import Fault, kill_at, latest_step

    layout, _ = disaggregated_reference
    problems = kill_at("trial", tmp_path / "run", layout, Fault(signal.SIGTERM, "drafter", at_step=3))
    assert problems == [], problems
    log = (tmp_path / "run.log").read_text()
    step = latest_step(tmp_path / "run")
    assert f"INTERRUPTED after step {step} of 10 (SIGTERM on rank 2 (drafter))" in log
    assert "WATCHDOG" not in log and "max_minutes" not in log  # not the watchdog, nor the wrong cause
    assert "[rank 0] target: stopped with the job" in log  # the target ranks were told


@pytest.mark.slow
def test_a_stopped_drafter_rank_is_named_not_its_peers(disaggregated_reference, tmp_path):
    """Issue 39: a drafter rank frozen by SIGSTOP was never named; its peers' watchdogs blamed
    themselves. The others name it (pid, role) while they wait, and their watchdog says it is the cause.
    The watchdog (8 s) outlasts the notice (STOPPED_NOTICE_S, 5 s), so both lines must appear. Once a
    watchdog exits its rank the test ends the job itself: torchrun would then wait out its SIGTERM grace
    on the stopped rank, which adds nothing to check."""
    from bench.chaos import env, job, last_step, workers

    layout, _ = disaggregated_reference
    out = tmp_path / "run"
    exited = re.compile(r"WATCHDOG\[rank[01] pid=\d+\]: exiting with code")  # after its message and stacks
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(job(out, layout, "train.watchdog_seconds=8"), env=env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        pid = None
        try:
            while last_step(out) < 3 and proc.poll() is None:
                time.sleep(0.2)
            pid = workers(proc.pid)[2]
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 240
            while (proc.poll() is None and time.monotonic() < deadline
                   and not exited.search((tmp_path / "run.log").read_text())):
                time.sleep(0.2)
        finally:
            # what is left of the job; torchrun starts each rank in a session of its own, so the stopped rank is not
            # in the launcher's group and is killed by its pid (else it outlived the suite, stopped, holding ~0.4 GB)
            for kill, target in ((os.killpg, proc.pid), (os.kill, pid)):
                try:
                    if target is not None:
                        kill(target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=60)
    text = (tmp_path / "run.log").read_text()
    assert exited.search(text), text[-3000:]  # a peer's watchdog ended its rank: the job does not hang
    note = f"rank 2 (drafter, pid {pid} on "
    assert any(note in line and "is stopped (state T" in line and "every other rank waits for it" in line
               for line in text.splitlines()), text[-3000:]  # named while they wait, before the watchdog
    assert any("WATCHDOG" in line and f"the cause: {note}" in line and "is stopped (state T" in line
               for line in text.splitlines()), text[-3000:]
