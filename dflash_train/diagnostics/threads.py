"""Independent jobs that share a machine's cores without dividing them.

torch gives every process as many intra-op threads as the machine has cores, and torchrun sets
OMP_NUM_THREADS=1 for its own processes; separate `dflash-train` jobs started side by side get
neither. Measured (docs/LOG.md, session 6): four jobs of 16 threads on 16 cores ran 6 s per step
instead of 0.43 s. `contention_notice` names the others and the setting that fixes it.
"""

from __future__ import annotations

import os
from pathlib import Path

MARKERS = ("dflash_train", "dflash-train")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1])  # after the command name: state, ppid
    except (OSError, IndexError, ValueError):
        return None


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid and pid not in seen:
        seen.add(pid)
        pid = _parent(pid)
    return seen


def other_jobs(pid: int | None = None) -> list[int]:
    """Pids of other `dflash-train` processes on this machine (not this one, its ancestors, its children)."""
    pid = pid or os.getpid()
    mine = _ancestors(pid)
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        other = int(entry.name)
        if any(m in _cmdline(other) for m in MARKERS) and pid not in _ancestors(other):
            found.append(other)
    return sorted(found)


def contention_notice(threads: int, cores: int | None = None, env: dict | None = None) -> str | None:
    """A warning when other dflash-train jobs run here, OMP_NUM_THREADS is unset and the jobs'
    threads together exceed the cores; None otherwise."""
    env = os.environ if env is None else env
    cores = cores or os.cpu_count() or 1
    if "OMP_NUM_THREADS" in env:
        return None
    others = other_jobs()
    if not others or threads * (len(others) + 1) <= cores:
        return None
    share = max(1, cores // (len(others) + 1))
    return (f"WARNING {len(others)} other dflash-train process(es) run on this machine (pids "
            f"{', '.join(map(str, others[:8]))}) and this one uses {threads} intra-op threads of {cores} cores: "
            f"jobs that share cores this way run many times slower; start each with OMP_NUM_THREADS={share}")
