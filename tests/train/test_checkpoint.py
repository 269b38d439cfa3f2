"""Checkpointer housekeeping: a temporary directory that a killed writer left behind (found by
bench/chaos.py: SIGKILL of the main drafter rank during a checkpoint write) is removed at the next
write, and never taken for a checkpoint."""

import torch
from transformers import Qwen3Config

from dflash_train.model.config import drafter_config_from_target
from dflash_train.model.drafter import DFlashDrafter
from dflash_train.train.checkpoint import Checkpointer, DrafterState, TrainProgress
from dflash_train.train.optim import MasterWeightAdamW


def _state() -> DrafterState:
    tcfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256)
    drafter = DFlashDrafter(drafter_config_from_target(tcfg, num_layers=1, block_size=4, mask_token_id=255,
                                                       num_taps=3))
    opt = MasterWeightAdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    return DrafterState(drafter, opt)


def test_a_killed_writers_temporary_directory_is_removed_at_the_next_write(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path, keep_last=3)
    ckpt.save(2, _state(), {"train": TrainProgress()}, {})
    stale = ckpt.root / ".step_00000004.tmp-k1lled"  # what atomic_dir leaves when its process dies
    (stale / "drafter").mkdir(parents=True)
    (stale / "trainer.pt").write_bytes(b"half")
    assert ckpt.latest().name == "step_00000002"  # never read as a checkpoint
    ckpt.save(4, _state(), {"train": TrainProgress()}, {})
    assert sorted(p.name for p in ckpt.root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert "removing .step_00000004.tmp-k1lled" in capsys.readouterr().out
    assert torch.load(ckpt.latest() / "trainer.pt", weights_only=True)["train"]["step"] == 0
