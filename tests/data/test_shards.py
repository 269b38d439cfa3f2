"""Shards: bf16 round-trips exactly, fp8 within its bound, a killed prepare resumes without a
partial shard, checksums are verified, and the reader resumes exactly from its state_dict."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train.data.records import TokenizedSample
from dflash_train.data.shards import (INDEX_NAME, ShardReader, check_disk_space, dequantize_fp8,
                                      prepare_shards, quantize_fp8)
from dflash_train.model.target.target import Target
from tests.conftest import tiny_qwen3

LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target():
    return Target(model=tiny_qwen3(vocab_size=300, seed=3), tokenizer=None, name="tiny")


def _samples(n: int, seed: int = 0) -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        ids = torch.randint(0, 300, (length,), generator=g).tolist()
        mask = torch.randint(0, 2, (length,), generator=g).tolist()
        out.append(TokenizedSample(f"s{i}", ids, mask))
    return out


def _fp8_bound(x: torch.Tensor) -> torch.Tensor:
    """|x - x_hat| <= max(2^-4 |x|, 2^-10 * scale): relative 2^-4 in e4m3's normal range after per-row
    scaling to amax/448, absolute half the subnormal step 2^-9 below it."""
    scale = x.abs().amax(-1, keepdim=True) / 448
    return torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)


def test_fp8_per_row_error_bound_on_wide_dynamic_range():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-4, 3, 64)[:, None]  # rows from 1e-4 to 1e3
    x[0, :10] = 0.0
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,) and scale.dtype == torch.float32
    err = (dequantize_fp8(q, scale) - x).abs()
    assert bool((err <= _fp8_bound(x)).all())
    assert float(err.max() / x.abs().max()) > 0  # it is lossy, so the bound is doing real work


def _reference_taps(target, sample):
    return target.taps(torch.tensor([sample.input_ids]), None, LAYERS)[0]  # (n, K*H)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_round_trip(tmp_path, target, fmt):
    samples = _samples(12)
    # batch_tokens=1: one sample per forward, so the reference computation is bit-identical
    report = prepare_shards(target, samples, tmp_path, LAYERS, fmt, shard_tokens=40, batch_tokens=1)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["complete"] and index["dtype"] == fmt and index["layer_ids"] == LAYERS
    assert index["hidden_size"] == 64 and index["target"] == "tiny" and report.shards == len(index["shards"]) > 2
    assert sum(s["samples"] for s in index["shards"]) == 12
    assert sum(s["tokens"] for s in index["shards"]) == sum(len(s.input_ids) for s in samples)
    reader = ShardReader(tmp_path, seed=0, dtype=torch.float32, verify="open")
    got = {s["id"]: s for s in reader}
    assert sorted(got) == sorted(s.id for s in samples)
    for sample in samples:
        row, ref = got[sample.id], _reference_taps(target, sample)
        assert row["input_ids"].tolist() == sample.input_ids and row["loss_mask"].tolist() == sample.loss_mask
        if fmt == "bf16":
            assert torch.equal(row["taps"], ref.to(torch.bfloat16).float())
        else:
            assert bool(((row["taps"] - ref).abs() <= _fp8_bound(ref)).all())


def test_killed_prepare_leaves_no_partial_shard_and_resumes(tmp_path, target):
    samples = _samples(15, seed=1)
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    prepare_shards(target, samples, full_dir, LAYERS, "bf16", shard_tokens=50, batch_tokens=1)

    def killed(shard_number):
        if shard_number == 1:
            raise KeyboardInterrupt  # killed right after shard 1 was indexed

    with pytest.raises(KeyboardInterrupt):
        prepare_shards(target, samples, cut_dir, LAYERS, "bf16", shard_tokens=50, batch_tokens=1, on_shard=killed)
    index = json.loads((cut_dir / INDEX_NAME).read_text())
    assert not index["complete"] and [s["file"] for s in index["shards"]] == ["shard-00000.safetensors",
                                                                              "shard-00001.safetensors"]
    (cut_dir / ".shard-00002.safetensors.tmp").write_bytes(b"half a shard")  # died mid-write
    (cut_dir / "shard-00002.safetensors").write_bytes(b"renamed, not indexed")
    partial = ShardReader(cut_dir, verify="open")  # readable as is: complete shards only
    assert len(partial) == sum(s["samples"] for s in index["shards"])
    report = prepare_shards(target, samples, cut_dir, LAYERS, "bf16", shard_tokens=50, batch_tokens=1)
    assert report.resumed_after == len(partial)
    assert not list(cut_dir.glob(".*tmp*"))
    full, resumed = json.loads((full_dir / INDEX_NAME).read_text()), json.loads((cut_dir / INDEX_NAME).read_text())
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in full["shards"]]
    ids = [s["id"] for s in ShardReader(cut_dir)]
    assert sorted(ids) == sorted(s.id for s in samples)


def test_resume_with_other_settings_is_refused(tmp_path, target):
    samples = _samples(4)
    prepare_shards(target, samples, tmp_path, LAYERS, "bf16", shard_tokens=50)
    with pytest.raises(ValueError, match="other settings.*layer_ids"):
        prepare_shards(target, samples, tmp_path, [0, 2], "bf16", shard_tokens=50)
    with pytest.raises(ValueError, match="samples_fingerprint"):
        prepare_shards(target, _samples(4, seed=9), tmp_path, LAYERS, "bf16", shard_tokens=50)


def test_checksum_mismatch_names_the_shard(tmp_path, target):
    prepare_shards(target, _samples(8), tmp_path, LAYERS, "bf16", shard_tokens=40)
    path = tmp_path / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the taps payload
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard shard-00001.safetensors .*sha256 mismatch"):
        ShardReader(tmp_path, verify="open")
    with pytest.raises(ValueError, match="shard-00001.safetensors"):
        list(ShardReader(tmp_path, verify="lazy"))
    # planning reads ids and masks only (no hashing, no taps); the first taps read still checks
    lazy = ShardReader(tmp_path, verify="lazy")
    tokens = [lazy.tokens(i) for i in range(len(lazy))]
    assert sorted(t["id"] for t in tokens) == sorted(s.id for s in _samples(8)) and not lazy._verified
    with pytest.raises(ValueError, match="shard-00001.safetensors"):
        [lazy.sample(i) for i in range(len(lazy))]


def test_disk_space_check_refuses(tmp_path):
    with pytest.raises(OSError, match="not enough disk space"):
        check_disk_space(tmp_path, 1 << 60)


def test_reader_order_is_seeded_sharded_and_resumes_exactly(tmp_path, target):
    prepare_shards(target, _samples(11), tmp_path, LAYERS, "fp8", shard_tokens=40)
    reader = ShardReader(tmp_path, seed=5)
    epoch0 = [s["id"] for s in reader]
    epoch1 = [s["id"] for s in reader]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"s{i}" for i in range(11)) and epoch0 != epoch1
    assert [s["id"] for s in ShardReader(tmp_path, seed=5)] == epoch0
    ranks = [[s["id"] for s in ShardReader(tmp_path, seed=5, rank=r, world=3)] for r in range(3)]
    assert [len(r) for r in ranks] == [3, 3, 3] and len(set(sum(ranks, []))) == 9  # equal counts, disjoint

    first = ShardReader(tmp_path, seed=5)
    it = iter(first)
    head = [next(it)["id"] for _ in range(4)]
    state = first.state_dict()
    resumed = ShardReader(tmp_path, seed=5)
    resumed.load_state_dict(state)
    assert head + [s["id"] for s in resumed] == epoch0
    assert [s["id"] for s in resumed] == epoch1  # and the next epoch continues the same sequence
    with pytest.raises(ValueError, match="world"):
        ShardReader(tmp_path, seed=5, world=2).load_state_dict(state)
    sample = next(iter(ShardReader(tmp_path, seed=5)))
    assert sample["taps"].dtype == torch.bfloat16 and sample["taps"].shape[1] == 2 * 64
    assert sample["input_ids"].dtype == torch.int64 and sample["loss_mask"].dtype == torch.uint8


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_final_hidden_is_stored_when_asked(tmp_path, target, fmt):
    """A distillation prepare also stores the target's final hidden state (after its final norm),
    recorded in the index's `entries`; bf16 exact, fp8 within its per-row bound."""
    samples = _samples(6)
    prepare_shards(target, samples, tmp_path, LAYERS, fmt, shard_tokens=40, batch_tokens=1, final_hidden=True)
    reader = ShardReader(tmp_path, seed=0, dtype=torch.float32)
    assert reader.entries == ["taps", "final_hidden"]
    got = {s["id"]: s for s in reader}
    for sample in samples:
        ids = torch.tensor([sample.input_ids])
        taps, final = target.taps(ids, None, LAYERS, return_last_hidden=True)
        ref = target.model(ids, output_hidden_states=True).hidden_states[-1][0]  # HF: after the final norm
        torch.testing.assert_close(final[0], ref)
        row = got[sample.id]
        assert row["final_hidden"].shape == (len(sample.input_ids), 64)
        if fmt == "bf16":
            assert torch.equal(row["final_hidden"], ref.to(torch.bfloat16).float())
            assert torch.equal(row["taps"], taps[0].to(torch.bfloat16).float())
        else:
            assert bool(((row["final_hidden"] - ref).abs() <= _fp8_bound(ref)).all())


def test_taps_only_shards_have_no_final_hidden(tmp_path, target):
    """A CE prepare stores no final hidden state (CE runs do not pay for it); an index written before
    entries were recorded reads as taps only, and resuming it as a taps-only prepare is allowed."""
    samples = _samples(5)
    prepare_shards(target, samples, tmp_path, LAYERS, "bf16", shard_tokens=40)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["entries"] == ["taps"]
    assert "final_hidden" not in next(iter(ShardReader(tmp_path)))
    del index["entries"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    assert ShardReader(tmp_path).entries == ["taps"]
    prepare_shards(target, samples, tmp_path, LAYERS, "bf16", shard_tokens=40)
    with pytest.raises(ValueError, match="entries"):
        prepare_shards(target, samples, tmp_path, LAYERS, "bf16", shard_tokens=40, final_hidden=True)
