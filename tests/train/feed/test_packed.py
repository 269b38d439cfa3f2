"""Packed stored rows against the per-sample reference (`TapsSpec.padded` of each sample's rows)."""

import pytest
import torch

from dflash_train.data.records import Sample
from dflash_train.data.regen_taps import TappedSamples
from dflash_train.train.feed import packed as packed_module
from dflash_train.train.feed.packed import AUTO_FREE_SHARE, PackedRows, placement
from dflash_train.train.feed.taps import FINAL_HIDDEN, StoredRows, TapsSpec, TensorField

SPEC = TapsSpec((TensorField("taps", 12, torch.bfloat16), TensorField(FINAL_HIDDEN, 4, torch.bfloat16)))


def _rows(lengths, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return [{f.name: torch.randn(n, f.width, generator=gen).to(dtype) for f in SPEC.fields} for n in lengths]


def _packed(per_sample, lengths):
    return PackedRows.of_lengths({name: torch.cat([r[name] for r in per_sample]) for name in SPEC.names}, lengths)


LENGTHS = [5, 17, 1, 30, 9, 24, 3, 12]  # shorter and longer than the padded lengths below


@pytest.mark.parametrize("seq_len", [8, 24, 40])
@pytest.mark.parametrize("gather", ["host", "device_route"])
def test_a_step_gathered_from_packed_rows_is_the_per_sample_padding(seq_len, gather):
    per_sample = _rows(LENGTHS)
    reference = StoredRows.in_memory(per_sample, SPEC.names)
    packed = _packed(per_sample, LENGTHS)
    for indices in ([3, 0, 5], [7], [2, 2, 6, 1], list(range(len(LENGTHS)))):
        want = reference.padded(indices, seq_len, SPEC)
        # the GPU's route (one index_select, the padding masked) runs on the CPU's tensors too
        got = (packed.padded(indices, seq_len, SPEC) if gather == "host"
               else packed._device_gather(indices, seq_len, SPEC))
        assert set(got) == set(want)
        for name in SPEC.names:
            assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype
            assert got[name].is_contiguous()
            assert torch.equal(got[name], want[name]), (name, indices)


def test_stored_rows_of_another_dtype_are_cast_to_the_specs():
    per_sample = _rows(LENGTHS, dtype=torch.float32)
    want = StoredRows.in_memory(per_sample, SPEC.names).padded([1, 4], 20, SPEC)
    got = _packed(per_sample, LENGTHS).padded([1, 4], 20, SPEC)
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], want[n]) for n in SPEC.names)


def test_a_subset_indexes_its_own_samples_and_shares_the_packed_tensors():
    per_sample = _rows(LENGTHS, seed=1)
    packed = _packed(per_sample, LENGTHS)
    train, held_out = packed.subset([0, 2, 3, 5, 6]), packed.subset([1, 4, 7])
    assert len(train) == 5 and len(held_out) == 3
    assert train.flat is packed.flat and held_out.flat is packed.flat
    for sub, originals in ((train, [0, 2, 3, 5, 6]), (held_out, [1, 4, 7])):
        for i, j in enumerate(originals):
            assert all(torch.equal(sub[i][n], per_sample[j][n]) for n in SPEC.names)
        want = StoredRows.in_memory([per_sample[j] for j in originals], SPEC.names).padded([1, 0], 16, SPEC)
        got = sub.padded([1, 0], 16, SPEC)
        assert all(torch.equal(got[n], want[n]) for n in SPEC.names)


def test_moving_packed_rows_copies_them_whole_in_chunks(monkeypatch):
    monkeypatch.setattr(packed_module, "COPY_CHUNK_BYTES", 7 * 12 * 2)  # 7 rows of taps a copy: a ragged last chunk
    per_sample = _rows(LENGTHS, seed=2)
    packed = _packed(per_sample, LENGTHS)
    moved = packed.to(torch.device("cpu"))
    assert all(moved.flat[n] is not packed.flat[n] and torch.equal(moved.flat[n], packed.flat[n]) for n in SPEC.names)
    assert torch.equal(moved.starts, packed.starts) and torch.equal(moved.lengths, packed.lengths)


def test_the_loaded_regenerate_and_tap_cache_is_packed_without_a_copy(tmp_path):
    lengths = [4, 7, 2]
    per_sample = _rows(lengths, seed=3)
    samples = [Sample(f"s{i}", tuple(range(n)), (1,) * n) for i, n in enumerate(lengths)]
    TappedSamples(samples, [r["taps"] for r in per_sample], [r[FINAL_HIDDEN] for r in per_sample]).save(
        tmp_path / "t.safetensors")
    loaded = TappedSamples.load(tmp_path / "t.safetensors")
    flat = loaded.packed()
    assert flat["taps"].shape == (sum(lengths), 12) and flat[FINAL_HIDDEN].shape == (sum(lengths), 4)
    assert flat["taps"].untyped_storage().data_ptr() == loaded.taps[0].untyped_storage().data_ptr()  # views of it
    packed = PackedRows.of_lengths(flat, lengths)
    for i in range(len(lengths)):
        assert all(torch.equal(packed[i][n], per_sample[i][n]) for n in SPEC.names)
    fresh = TappedSamples(samples, [r["taps"] for r in per_sample])  # not loaded: packed by concatenation
    assert torch.equal(fresh.packed()["taps"], flat["taps"]) and FINAL_HIDDEN not in fresh.packed()


GB = 10 ** 9


@pytest.mark.parametrize("mode, nbytes, free, on_device, said", [
    ("auto", 15 * GB, 78 * GB, True, "auto"),
    ("auto", 47 * GB, 78 * GB, False, "over data.taps_device=auto"),
    ("host", 1 * GB, 78 * GB, False, "data.taps_device=host"),
    ("device", 70 * GB, 78 * GB, True, "data.taps_device=device"),
])
def test_where_the_rows_go_and_the_line_that_says_why(mode, nbytes, free, on_device, said):
    where, why = placement(mode, nbytes, torch.device("cuda", 0), free)
    assert where is on_device and said in why and f"{nbytes / GB:.1f} GB" in why
    assert (nbytes / free <= AUTO_FREE_SHARE) is on_device or mode != "auto"


@pytest.mark.parametrize("mode", ["auto", "device", "host"])
def test_a_cpu_run_keeps_them_in_host_memory_whatever_the_setting(mode):
    where, why = placement(mode, GB, torch.device("cpu"), None)
    assert where is False and "host memory" in why
