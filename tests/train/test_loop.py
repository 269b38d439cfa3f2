import torch
import torch.distributed as dist

from dflash_train.model.config import DrafterConfig
from dflash_train.train import loop
from dflash_train.train.step import StepContext


def _ctx(num_drafters: int) -> StepContext:
    w = torch.zeros(4, 2)
    dcfg = DrafterConfig(hidden_size=2, intermediate_size=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2,
                         vocab_size=4, block_size=2, mask_token_id=0, target_layer_ids=(0,), num_target_layers=2)
    return StepContext(embed_weight=w, lm_head_weight=w, drafter=dcfg, gamma=1.0, chunk_tokens=4, backend="sdpa",
                       device=torch.device("cpu"), autocast_dtype=None, num_drafters=num_drafters)


def test_agree_syncs_several_drafters_only_every_few_steps(tmp_path):
    """One drafter stops at once; several compare flags (all-reduce MAX, a host sync) only every
    AGREE_EVERY steps, and then any rank's flag stops all of them."""
    assert loop._agree(True, _ctx(1), step=1) and not loop._agree(False, _ctx(1), step=4)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        several = _ctx(2)
        assert not loop._agree(True, several, step=loop.AGREE_EVERY + 1)  # no collective off the beat
        assert loop._agree(True, several, step=loop.AGREE_EVERY)
        assert not loop._agree(False, several, step=2 * loop.AGREE_EVERY)
        assert loop._agree_min(7, several) == 7  # a world of one: its own value
    finally:
        dist.destroy_process_group()
