"""A full disk during a checkpoint write: a clear error naming the checkpoint and the intact
previous one, no half-written directory, and `latest` still pointing at the previous step.

The disk is a real 2 MiB tmpfs mounted in a private mount namespace (`unshare --user --mount`,
no privileges needed where user namespaces are allowed); the write fails with the kernel's own
ENOSPC, nothing is mocked."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    from pathlib import Path
    import torch
    from dflash_train.model.drafter.config import drafter_config_from_target
    from dflash_train.model.drafter.backbone import DFlashDrafter
    from dflash_train.train.state.checkpoint import Checkpointer, CheckpointWriteError, DrafterState, TrainProgress
    from dflash_train.train.optim.optimizer import MasterWeightAdamW
    from transformers import Qwen3Config

    disk = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)
    tcfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256)
    drafter = DFlashDrafter(drafter_config_from_target(tcfg, num_layers=2, block_size=4, mask_token_id=255,
                                                       num_taps=3))
    opt = MasterWeightAdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt, progress = Checkpointer(disk / "run", keep_last=3), TrainProgress()
    for p in drafter.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the Adam moments: trainer.pt is then twice the weights
    first = ckpt.save(1, DrafterState(drafter, opt), {"train": progress, "optimizer": opt}, {})
    before = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    room = 64 * 1024  # less than any checkpoint file
    if sys.argv[2] == "weights":  # room for the drafter's weights, not for the optimizer state after them
        room = (first / "drafter" / "model.safetensors").stat().st_size + 96 * 1024
    (disk / "filler").write_bytes(b"0" * (free - room))
    try:
        ckpt.save(2, DrafterState(drafter, opt), {"train": progress, "optimizer": opt}, {})
    except CheckpointWriteError as e:
        print("ERROR", str(e).replace(chr(10), " "))
    after = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}
    print("INTACT", after == before and len(before) > 0)
    print("LATEST", ckpt.latest().name)
    print("ENTRIES", sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()))
""")


def _unshare() -> list[str] | None:
    """A command prefix that runs in a private mount namespace where tmpfs can be mounted."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return ["unshare", "--user", "--map-root-user", "--mount"] if probe.returncode == 0 else None


@pytest.mark.parametrize("room", ["small", "weights"])
def test_a_full_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one(tmp_path, room):
    """`small`: the drafter's weights do not fit (safetensors fails); `weights`: they do, and
    torch.save of the optimizer state fails after them (its own error reads `unexpected pos`)."""
    prefix = _unshare()
    if prefix is None:
        pytest.skip("no user+mount namespaces here (unshare --user --mount): cannot mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(prefix + [sys.executable, "-c", SCRIPT, str(disk), room], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert "step_00000002 not written" in lines["ERROR"] and "No space left on device" in lines["ERROR"]
    assert "step_00000001 is intact" in lines["ERROR"] and "unexpected pos" not in lines["ERROR"]
    assert lines["INTACT"] == "True" and lines["LATEST"] == "step_00000001"
    assert lines["ENTRIES"] == "['latest', 'step_00000001']"  # no temporary directory left behind
