"""Regenerate + tap in one pass: the kept taps equal a separate full forward of the final ids."""

import torch

from dflash_train.data.conversations import prompt_messages, render_chat
from dflash_train.data.records import Conversation
from dflash_train.data.regen_taps import TappedSamples, regenerate_with_taps

IDS = [1, 3, 4]


def test_taps_from_generation_equal_a_full_forward(smollm2_target, tmp_path):
    target = smollm2_target
    convs = [Conversation("long", [{"role": "user", "content": "Explain how a bicycle stays upright."}]),
             Conversation("short", [{"role": "user", "content": "hi"}]),
             Conversation("mid", [{"role": "user", "content": "Give me one tip for sleeping better."}])]
    tapped, report = regenerate_with_taps(target, convs, IDS, max_new_tokens=24, batch_size=3, max_len=256,
                                          storage_dtype=torch.float32)
    assert report["samples"] == 3 and report["new_tokens"] == sum(sum(s.loss_mask) for s in tapped.samples)
    for sample, taps in zip(tapped.samples, tapped.taps):
        ids = torch.tensor([sample.input_ids])
        n = len(sample) - 1  # the last response token is never fed back: no tap
        full = target.taps(ids, None, IDS)[0]
        torch.testing.assert_close(taps[:n], full[:n], rtol=1e-4, atol=1e-4)
        assert taps[-1].abs().sum() == 0
        # the response is the target's own greedy continuation of the prompt
        prompt_len = sample.loss_mask.index(1)
        greedy = target.model(ids).logits[0, prompt_len - 1:-1].argmax(-1)
        assert greedy.tolist() == list(sample.input_ids[prompt_len:])
    by_id = {s.id: s for s in tapped.samples}
    assert by_id
    for conv, sample in ((c, by_id[c.id]) for c in convs if c.id in by_id):
        text = render_chat(target.tokenizer, prompt_messages(conv.messages), add_generation_prompt=True)
        alone = target.tokenizer(text, add_special_tokens=False)["input_ids"]  # the prompts are encoded in one call
        assert list(sample.input_ids[:sample.loss_mask.index(1)]) == alone
    path = tmp_path / "t.safetensors"
    tapped.save(path)
    again = TappedSamples.load(path)
    assert again.samples == tapped.samples and all(torch.equal(a, b) for a, b in zip(again.taps, tapped.taps))


def test_mapped_taps_equal_the_saved_ones_and_share_the_file(tmp_path):
    """`TappedSamples.load` maps the taps instead of reading them: the same values, dtypes and shapes,
    and the tensors' memory is the file's mapping (no private copy per process)."""
    from dflash_train.data.records import Sample

    g = torch.Generator().manual_seed(0)
    samples = [Sample(f"s{i}", tuple(range(n)), (0,) * (n - 2) + (1, 1)) for i, n in enumerate((5, 3, 7))]
    taps = [torch.randn(len(s), 6, generator=g).to(torch.bfloat16) for s in samples]
    final = [torch.randn(len(s), 2, generator=g).to(torch.bfloat16) for s in samples]
    path = tmp_path / "t.safetensors"
    TappedSamples(samples, taps, final).save(path)
    again = TappedSamples.load(path)
    assert again.samples == samples
    for a, b in zip(again.taps + again.final_hidden, taps + final):
        assert a.dtype == b.dtype and torch.equal(a, b)
    address = again.taps[0].data_ptr()
    maps = [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(str(path))]
    assert any(int(m[0].split("-")[0], 16) <= address < int(m[0].split("-")[1], 16) for m in maps)  # the file's pages


def test_the_streamed_file_is_what_safetensors_reads(tmp_path):
    """`write_safetensors` writes a list as its pieces one after the other (no concatenation in memory): safetensors'
    own reader gives the concatenation, every dtype the file holds, an empty piece and the metadata."""
    from safetensors import safe_open

    from dflash_train.data.regen_taps import write_safetensors

    g = torch.Generator().manual_seed(1)
    pieces = [torch.randn(n, 4, generator=g).to(torch.bfloat16) for n in (3, 0, 5, 1)]
    tensors = {"lengths": torch.tensor([3, 0, 5, 1]), "ids": torch.arange(9, dtype=torch.int32),
               "mask": torch.tensor([0, 1] * 4 + [1], dtype=torch.uint8), "taps": pieces,
               "f32": [torch.randn(2, 3, generator=g), torch.randn(4, 3, generator=g)]}
    path = tmp_path / "s.safetensors"
    write_safetensors(path, tensors, {"ids": "a\nb"})
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"ids": "a\nb"} and set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            want = torch.cat(t) if isinstance(t, list) else t
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
