"""A target split into 3 pipeline stages over 3 gloo processes gives the single-process taps and
final hidden state (float32, tiny random Qwen3, Llama, Qwen3-MoE, gpt-oss, and where the installed
transformers has them Gemma 3 (sliding window), Qwen3-Next and Qwen3.5 (hybrid linear attention));
stage bounds are balanced and every layer is held by exactly one stage."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from dflash_train.model.target.pipeline_stages import PipelineStage, as_stage, stage_bounds
from dflash_train.model.target.target import Target

from tests.model.drafter.heads.test_architectures import ARCHS as OTHER_ARCHS
from tests.model.target.test_tensor_parallel import ARCHS as TP_ARCHS, RTOL, ATOL, tiny

WORLD = 3
# gpt-oss: its TP plan shards no decoder layer, the case stages exist for
ARCHS = TP_ARCHS + tuple(a for a in ("gpt_oss",) if all(hasattr(transformers, c) for c in OTHER_ARCHS[a][:2]))


def test_stage_bounds_are_balanced_and_cover_every_layer():
    assert stage_bounds(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    for layers in range(1, 13):
        for stages in range(1, layers + 1):
            bounds = stage_bounds(layers, stages)
            assert [b[0] for b in bounds[1:]] == [b[1] for b in bounds[:-1]] and bounds[0][0] == 0
            assert bounds[-1][1] == layers
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="3 decoder layers cannot fill 4 pipeline stages"):
        stage_bounds(3, 4)


def _compare_on_rank(rank: int, world: int, init_file: str, report_dir: str) -> None:
    """Every rank runs its stage of each architecture; the last stage compares with one process's
    taps and, when all passed, writes the architectures it checked."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    checked = []
    try:
        torch.manual_seed(1)
        ids = torch.randint(0, 256, (2, 24))  # (b, S): longer than the sliding windows (8)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # a left-padded row
        for arch in ARCHS:
            reference = Target(tiny(arch), tokenizer=None)
            n = reference.num_layers
            stage = as_stage(Target(tiny(arch), tokenizer=None), list(range(world)), rank)
            start, end = stage_bounds(n, world)[rank]
            assert isinstance(stage, PipelineStage) and (stage.start, stage.end) == (start, end)
            assert len(stage.layers) == end - start and stage.num_layers == n
            assert reference.config.get_text_config().num_hidden_layers == n  # the model's config stays whole
            tap_ids = [0, n - 2, n - 1]  # the last one's tap is the final-norm output, as HF's
            got = stage.taps(ids, mask, tap_ids, return_last_hidden=True)
            if rank < world - 1:
                assert got is None  # passed on to the next stage
                continue
            want_taps, want_last = reference.taps(ids, mask, tap_ids, return_last_hidden=True)
            torch.testing.assert_close(got[0], want_taps, rtol=RTOL, atol=ATOL, msg=lambda m: f"{arch} taps: {m}")
            torch.testing.assert_close(got[1], want_last, rtol=RTOL, atol=ATOL, msg=lambda m: f"{arch} last: {m}")
            assert want_taps.abs().max() > 1.0  # the states are not ~0: the tolerance means something
            checked.append(arch)
        if rank == world - 1:
            (Path(report_dir) / "checked").write_text(",".join(checked))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_three_stages_give_single_process_taps(tmp_path):
    mp.spawn(_compare_on_rank, args=(WORLD, str(tmp_path / "pg"), str(tmp_path)), nprocs=WORLD, join=True)
    assert (tmp_path / "checked").read_text().split(",") == list(ARCHS)
