import torch
import torch.distributed as dist

from dflash_train.model.drafter.config import DrafterConfig
from dflash_train.train import loop
from dflash_train.train.step import StepContext


def _ctx(num_drafters: int) -> StepContext:
    w = torch.zeros(4, 2)
    dcfg = DrafterConfig(hidden_size=2, intermediate_size=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                         vocab_size=4, block_size=2, mask_token_id=0, target_layer_ids=(0,), num_target_layers=2)
    return StepContext(embed_weight=w, lm_head_weight=w, drafter=dcfg, gamma=1.0, chunk_tokens=4, backend="sdpa",
                       device=torch.device("cpu"), autocast_dtype=None, num_drafters=num_drafters)


def test_agree_min_of_a_world_of_one_is_its_own_value(tmp_path):
    """The drafter ranks' smallest value (the time budget's step count, train/optim/optimizer.py TimeBudget)."""
    assert loop._agree_min(7, _ctx(1)) == 7
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert loop._agree_min(7, _ctx(2)) == 7  # the collective path, in a world of one
    finally:
        dist.destroy_process_group()
