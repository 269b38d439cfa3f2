"""The notice for independent jobs that share the cores: found by a real second process whose
command line names dflash_train, silent when OMP_NUM_THREADS is set or the threads fit."""

import os
import signal
import subprocess
import sys
import time

from dflash_train.diagnostics.threads import contention_notice, other_jobs


def _detached_job() -> int:
    """A process that is not ours (its shell parent exits, it is re-parented): another user's job."""
    shell = subprocess.run(["sh", "-c", f"'{sys.executable}' -c 'import time; time.sleep(120)' "
                                        "--fake-dflash_train-job >/dev/null 2>&1 & echo $!"],
                           capture_output=True, text=True, check=True)
    return int(shell.stdout.strip())


def test_a_second_job_on_shared_cores_is_named_with_the_fix():
    other = _detached_job()
    try:
        for _ in range(100):  # its command line appears in /proc once the interpreter has started
            if other in other_jobs():
                break
            time.sleep(0.05)
        assert other in other_jobs()
        notice = contention_notice(threads=4, cores=4, env={})
        assert notice is not None and str(other) in notice
        assert "this one uses 4 intra-op threads of 4 cores" in notice
        assert notice.endswith(f"OMP_NUM_THREADS={max(1, 4 // (len(other_jobs()) + 1))}")
        assert contention_notice(threads=4, cores=4, env={"OMP_NUM_THREADS": "2"}) is None  # divided already
        assert contention_notice(threads=1, cores=64, env={}) is None  # the threads fit the cores
    finally:
        os.kill(other, signal.SIGKILL)
    for _ in range(100):
        if other not in other_jobs():
            break
        time.sleep(0.05)
    assert other not in other_jobs()


def test_this_process_its_parents_and_its_children_are_not_others():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "dflash_train"])
    try:
        time.sleep(0.5)
        jobs = other_jobs()
        assert os.getpid() not in jobs and os.getppid() not in jobs
        assert child.pid not in jobs  # a job's own subprocesses (compile workers, tests' jobs) are its own
    finally:
        child.kill()
        child.wait()
