"""A small real drafter and its optimizer, the state the checkpoint tests write and read."""

import torch
from transformers import Qwen3Config

from dflash_train.model.drafter.backbone import DFlashDrafter
from dflash_train.model.drafter.config import drafter_config_from_target
from dflash_train.train.optim.optimizer import MasterWeightAdamW
from dflash_train.train.state.checkpoint import DrafterState


def drafter_state(moments: bool = False) -> DrafterState:
    """One layer over a 6-layer Qwen3 shape; with `moments`, one AdamW step taken so the optimizer has state."""
    tcfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256)
    drafter = DFlashDrafter(drafter_config_from_target(tcfg, num_layers=1, block_size=4, mask_token_id=255,
                                                       num_taps=3))
    opt = MasterWeightAdamW(drafter.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    if moments:
        for p in drafter.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return DrafterState(drafter, opt)
