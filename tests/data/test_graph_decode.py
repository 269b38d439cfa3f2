"""The fixed-shape decode (data/graph_decode.py) gives what the dynamic loop gives: the same greedy
tokens, taps and final hidden states, for a batch padded with dummy rows, rows stopping at
different steps and a later batch of another width reusing the cache."""

import torch

from dflash_train.data import graph_decode
from dflash_train.data.records import Conversation
from dflash_train.data.regen_taps import regenerate_with_taps

IDS = [1, 3, 4]
REQUESTS = ["Explain how a bicycle stays upright.", "hi", "Give me one tip for sleeping better.",
            "What is 2+2?", "Write a haiku about rain on a tin roof, then explain its imagery."]


def _run(target, graph: bool):
    convs = [Conversation(f"c{i}", [{"role": "user", "content": text}]) for i, text in enumerate(REQUESTS)]
    return regenerate_with_taps(target, convs, IDS, max_new_tokens=20, batch_size=3, max_len=256,
                                storage_dtype=torch.float32, final_hidden=True, graph=graph)


def test_fixed_shape_decode_equals_the_dynamic_loop(smollm2_target):
    (fixed, fixed_report), (dynamic, dynamic_report) = _run(smollm2_target, True), _run(smollm2_target, False)
    assert fixed.samples == dynamic.samples  # same ids, same loss masks: same greedy responses
    assert fixed_report["new_tokens"] == dynamic_report["new_tokens"]
    stopped = [s for s in fixed.samples if len(s) - s.loss_mask.index(1) < 20]
    assert stopped and len(stopped) < len(fixed.samples)  # some rows stop early, some run to the end
    for a, b in zip(fixed.taps + fixed.final_hidden, dynamic.taps + dynamic.final_hidden):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert a[-1].abs().sum() == 0  # the last response token is never fed back


def test_supports_only_full_attention_single_device_targets(smollm2_target):
    assert graph_decode.supports(smollm2_target.model)
    config = smollm2_target.model.config
    saved = getattr(config, "layer_types", None)
    try:
        config.layer_types = ["sliding_attention"] + ["full_attention"] * (config.num_hidden_layers - 1)
        assert not graph_decode.supports(smollm2_target.model)
    finally:
        config.layer_types = saved
