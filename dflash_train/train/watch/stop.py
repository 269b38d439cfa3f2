"""Stopping a job of any layout: every rank stops after one agreed step, and a rank that ends
early is named by the others.

Requests. SIGTERM, SIGINT or SIGHUP to any process (torchrun forwards them from the launcher to
every rank), the launcher's death (this process's parent changes: `PeerWatch`), or a spent time
budget. Inside the training loop a request is a code (`StopFlag.code`); anywhere else a signal
stops the process at once (`StopNow`), as does a second signal more than REPEAT_WINDOW_S after
the first (one request delivered twice, by the launcher and by the terminal or scheduler, is one).

Agreement (`StopVote`). After each step every rank posts its code in a non-blocking all-reduce
over a gloo group of the whole world (CPU tensors: no device sync, and it never shares a stream
or a communicator with the taps or the gradients). Before step s a rank waits only for the vote
posted after step s - 1 - slack, long done when no rank lags: targets run ahead of drafters by
the back-pressure window, so `slack` covers it and the vote costs no pipeline bubble. A vote
posted after step k that holds a request stops every rank after step k + lag, lag = slack + 1 +
the drafters' prefetch: every rank learns it before it computes, sends or posts a receive for a
later step, so nothing is left in flight. The drafters checkpoint that step, then `finish` holds
every rank (targets included) at a barrier until the checkpoint is written: torchrun tears the
job down as soon as one rank exits, so no rank may leave before it. The main drafter rank then
prints the one INTERRUPTED verdict.

Ranks that end early (`PeerWatch`). A daemon thread checks every WATCH_EVERY_S that the ranks on
this host still run (their pids, gathered at start-up); a rank whose process is stopped (SIGSTOP, a
debugger) is named after STOPPED_NOTICE_S, and the watchdog's message names it when the stall ends the
job (its peers are not blamed); a rank whose process is gone while the job runs is named: the main
thread's error (a gloo `Connection closed by peer`) is explained with its rank and role, and if the
main thread is stuck (an NCCL collective) the thread ends this process itself after GRACE_S, with the
verdict line. Ranks on other hosts are named by host from the broken connection's address.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

CODES = ("", "SIGTERM", "SIGINT", "SIGHUP", "the launcher died", "train.max_minutes spent")
SIGNAL_CODES = {signal.SIGTERM: 1, signal.SIGINT: 2, signal.SIGHUP: 3}
LAUNCHER_DIED, BUDGET_SPENT = 4, 5
REPEAT_WINDOW_S = 2.0
WATCH_EVERY_S, GRACE_S = 0.5, 3.0
STOPPED_NOTICE_S = 5.0  # a peer stopped (SIGSTOP, a debugger) this long is named
PREFETCH = 1  # RemoteSource posts the receives of this many steps ahead


class StopNow(KeyboardInterrupt):
    """A signal outside the training loop (or repeated): this process stops at once. A
    KeyboardInterrupt, so no `except Exception` swallows it and cli.py prints INTERRUPTED."""


class StopFlag:
    """This process's stop request (see the module doc); signal handlers are installed at once."""

    def __init__(self):
        self.code = 0
        self.at = -REPEAT_WINDOW_S  # when a signal was last acted on: a request recorded or a stop at once
        self.deferring = False  # inside the training loop: a request is voted on, not acted on alone
        self.settled = False  # the job's stop is done: later signals (torchrun's teardown) are ignored
        self.phase = "during setup: nothing new was trained; run the same command again (with --resume to continue)"
        for sig in SIGNAL_CODES:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.settled or now - self.at < REPEAT_WINDOW_S:
            return  # the same request delivered twice (a launcher's forward, `timeout` and a shell): one stop
        if not self.deferring or self.code:
            print(f"{name}: stopping now", flush=True)
            self.at = now  # a second copy arriving while the first unwinds would raise out of cleanup
            raise StopNow(f"{name} {self.phase}")
        self.request(SIGNAL_CODES[signum])
        print(f"{name}: every rank stops after one agreed step, which is checkpointed (again to stop at once)",
              flush=True)

    def request(self, code: int) -> None:
        if not self.code:
            self.code, self.at = code, time.monotonic()

    def __call__(self) -> bool:
        return self.code != 0

    @property
    def signal(self) -> str | None:
        return CODES[self.code] or None


class StopVote:
    """The agreement on the step every rank stops after (see the module doc)."""

    def __init__(self, rank: int, world_size: int, group, slack: int, lag: int):
        self.rank, self.world_size, self.group, self.slack, self.lag = rank, world_size, group, slack, lag
        self.pending: collections.deque = collections.deque()  # (step, votes, work)
        self.stop_step: int | None = None
        self.requests: dict[int, int] = {}  # rank -> code of the vote that stopped the job

    @classmethod
    def for_topology(cls, topo, group, max_in_flight: int) -> "StopVote":
        if not topo.distributed:
            return cls(0, 1, None, 0, 0)
        if not topo.has_target_ranks:  # drafter ranks only: their all-reduces keep them within a step
            return cls(topo.rank, topo.world_size, group, 1, 2)
        slack = min(max_in_flight, 2)  # how far targets run ahead of drafters (back-pressure, prefetch)
        return cls(topo.rank, topo.world_size, group, slack, slack + 1 + PREFETCH)

    def after_step(self, step: int, code: int) -> None:
        """Post this rank's request (0: none) after `step`."""
        if self.world_size == 1:
            self._decide(step, {0: code} if code else {})
            return
        votes = torch.zeros(self.world_size, dtype=torch.int64)
        votes[self.rank] = code
        self.pending.append((step, votes, dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group,
                                                           async_op=True)))

    def before_step(self, step: int) -> None:
        """Read the votes every rank must know before `step` (see the module doc)."""
        while self.pending and self.pending[0][0] <= step - 1 - self.slack:
            self._settle()

    def _settle(self) -> None:
        step, votes, work = self.pending.popleft()
        work.wait()
        self._decide(step, {rank: code for rank, code in enumerate(votes.tolist()) if code})

    def _decide(self, step: int, requests: dict[int, int]) -> None:
        """The first vote with a request fixes the stop step; later ones only add who asked (every
        rank reads the same votes, so all name the same ranks)."""
        if requests and self.stop_step is None:
            self.stop_step = step + self.lag
        for rank, code in requests.items():
            self.requests.setdefault(rank, code)

    def stops_after(self, step: int) -> bool:
        return self.stop_step is not None and step >= self.stop_step

    def finish(self) -> None:
        """Read the last votes, then wait until every rank is here (the checkpoint is written)."""
        while self.pending:
            self._settle()
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def interruption(self, stop: StopFlag, topo, step: int) -> dict | None:
        """Where and why the job was asked to stop (a signal or the launcher's death on any rank;
        a spent budget is a normal end), or None. From here on a signal stops this process at once."""
        stop.deferring, stop.phase = False, f"after step {step}, which is checkpointed: continue with --resume"
        requests = {rank: code for rank, code in self.requests.items() if code != BUDGET_SPENT}
        if not requests and stop():
            requests = {topo.rank: stop.code}  # a signal after this rank's last vote: only this rank knows
        if not requests:
            return None
        self.requests, stop.settled = requests, True  # torchrun's teardown signals, as ranks exit, change nothing
        return {"step": step, "cause": self.cause(topo.role)}

    def message(self, step: int, role_of, max_minutes) -> str:
        """The log line of the step the job stops after."""
        if any(code != BUDGET_SPENT for code in self.requests.values()):
            return f"stopping at step {step}: {self.cause(role_of)}; it is checkpointed: continue with --resume"
        # the budget carries over on resume, so only a larger one trains further
        return (f"stopping at step {step}: train.max_minutes={max_minutes} spent; continue with --resume and a "
                "larger train.max_minutes (the time spent carries over)")

    def cause(self, role_of) -> str:
        """`SIGTERM on rank 3 (drafter)`, `SIGTERM on every rank`, ...: who asked, and how."""
        by_code = collections.defaultdict(list)
        for rank, code in sorted(self.requests.items()):
            by_code[code].append(rank)
        parts = []
        for code, ranks in by_code.items():
            who = ("every rank" if len(ranks) == self.world_size > 1 else
                   f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(f"{r} ({role_of(r)})" for r in ranks))
            parts.append(f"{CODES[code]}, seen on {who}" if code == LAUNCHER_DIED else f"{CODES[code]} on {who}")
        return "; ".join(parts)


class PeerLost(RuntimeError):
    """Another rank ended while the job ran; this rank stops, naming it."""

    readable = True  # cli.py: the message alone, no traceback


_COMM_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
                "NCCL communicator was aborted", "ProcessGroupNCCL", "DistNetworkError")


class PeerWatch:
    """Watches the launcher and this host's other ranks from a daemon thread (see the module doc).
    `start` is collective (an all-gather of every rank's pid and host over `group`)."""

    def __init__(self, topo, stop: StopFlag, log):
        self.topo, self.stop_flag, self.log = topo, stop, log
        self.host = socket.gethostname()
        self.peers: list[tuple[int, str]] = []  # (pid, host) by rank
        self.gone: dict[int, float] = {}  # rank -> when its process was found gone
        self.stopped: dict[int, float] = {}  # rank -> since when its process is stopped (state T or t)
        self.named_stopped: set[int] = set()
        self.launcher = os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else None
        self.failing = False  # the main thread reports the failure itself
        self.held = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, group) -> "PeerWatch":
        if self.topo.distributed:
            gathered = [None] * self.topo.world_size
            dist.all_gather_object(gathered, (os.getpid(), self.host), group=group)
            self.peers = gathered
        if self.launcher is not None or self.topo.distributed:
            self._thread = threading.Thread(target=self._watch, name="peer-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """The job is over for this rank: later exits of the others are expected."""
        self._done.set()

    @contextlib.contextmanager
    def holding(self):
        """A block the thread never cuts short (a checkpoint being written stays worth finishing)."""
        self.held = True
        try:
            yield
        finally:
            self.held = False

    def _watch(self) -> None:
        while not self._done.wait(WATCH_EVERY_S):
            if self.launcher is not None and os.getppid() != self.launcher:
                self.log(f"the launcher (pid {self.launcher}) died: every rank stops after one agreed step, "
                         "which is checkpointed")
                self.stop_flag.request(LAUNCHER_DIED)
                self.launcher = None
            self._check_peers()
            if self.gone and not (self.failing or self.held) and time.monotonic() - min(self.gone.values()) > GRACE_S:
                self._end_stuck_process()

    def _check_peers(self) -> None:
        for rank, (pid, host) in enumerate(self.peers):
            if rank == self.topo.rank or host != self.host or rank in self.gone:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                self.gone[rank] = time.monotonic()
                continue
            except PermissionError:
                continue  # a pid reused by another user's process: it still exists
            self._check_running(rank, pid)

    def _check_running(self, rank: int, pid: int) -> None:
        """A peer that exists but is stopped (SIGSTOP, Ctrl-Z, a debugger) holds every rank in its next
        collective; name it once it has been stopped STOPPED_NOTICE_S, and again if it goes on."""
        if _process_state(pid) not in ("T", "t"):
            self.stopped.pop(rank, None)
            self.named_stopped.discard(rank)
            return
        since = self.stopped.setdefault(rank, time.monotonic())
        if rank not in self.named_stopped and time.monotonic() - since >= STOPPED_NOTICE_S:
            self.named_stopped.add(rank)
            self.log(f"{self.stopped_note()}: every other rank waits for it in its next collective; `kill -CONT "
                     f"{self.peers[rank][0]}` lets it go on, or stop the job")

    def stopped_note(self) -> str:
        """Which peers of this host are stopped, and for how long ("" when none): for the watchdog's
        message, so a stall is blamed on the rank that causes it."""
        now = time.monotonic()
        return "; ".join(f"{self.describe(r)} is stopped (state T: SIGSTOP, Ctrl-Z or a debugger) for "
                         f"{now - since:.0f} s" for r, since in sorted(self.stopped.items()))

    def describe(self, rank: int) -> str:
        pid, host = self.peers[rank] if rank < len(self.peers) else ("?", "?")
        return f"rank {rank} ({self.topo.role(rank)}, pid {pid} on {host})"

    def _end_stuck_process(self) -> None:
        """The main thread is still blocked on a rank that is gone (e.g. in an NCCL collective)."""
        names = ", ".join(self.describe(r) for r in sorted(self.gone))
        print(f"dflash-train train: FAILED on rank {self.topo.rank}: {names} ended while the job ran (killed, or "
              f"failed: see its own lines); this rank was blocked waiting for it", flush=True)
        sys.stdout.flush()
        os._exit(1)

    def explain(self, error: BaseException) -> BaseException:
        """`error` as this rank reports it: a lost connection becomes a PeerLost naming the rank
        (or host) that is gone; anything else stays as it is."""
        self.failing = True
        text = f"{type(error).__name__}: {error}"
        if not self.topo.distributed or not any(marker in text for marker in _COMM_ERRORS):
            return error
        deadline = time.monotonic() + GRACE_S
        while not self.gone and time.monotonic() < deadline:  # the watch may not have looked yet
            self._check_peers()
            time.sleep(0.1)
        if self.gone:
            who = ", ".join(self.describe(r) for r in sorted(self.gone))
            return PeerLost(f"{who} ended while the job ran (killed, or failed: see its own lines); this rank lost "
                            f"its connection ({_short(text)}); continue from the last checkpoint with --resume")
        hosts = set(re.findall(r"\[([0-9a-fA-F.:]+)\]:\d+", text))
        ranks = [r for r, (_, host) in enumerate(self.peers) if _address_of(host) in hosts and host != self.host]
        where = f"rank(s) {ranks} on {sorted(hosts)}" if ranks else "another rank"
        return PeerLost(f"lost the connection to {where} ({_short(text)}): it ended while the job ran; "
                        "continue from the last checkpoint with --resume")


def _process_state(pid: int) -> str:
    """The one-letter state of a process of this host (/proc/<pid>/stat), "" when unknown."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else ""


def _short(text: str) -> str:
    return text.split(". This is typically")[0][:200]


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host
