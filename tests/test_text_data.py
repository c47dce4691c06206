"""Tests for examples/text_data.py: the byte-level standard-library corpus and its batches."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))

import pytest
import torch

from text_data import ByteDataset, decode, encode, load_stdlib_text

MAX_BYTES = 200_000  # enough for many files, small enough to load in milliseconds


@pytest.fixture(scope="module")
def dataset() -> ByteDataset:
    return ByteDataset(load_stdlib_text(MAX_BYTES))


def test_load_respects_max_bytes_and_is_real_python() -> None:
    text = load_stdlib_text(MAX_BYTES)
    assert len(text) == MAX_BYTES  # the standard library holds far more than this
    assert b"def " in text and b"import " in text
    assert len(load_stdlib_text(1_000)) == 1_000


def test_load_is_a_prefix_of_a_longer_load() -> None:
    # The file order is fixed, so a shorter corpus is the start of a longer one.
    assert load_stdlib_text(2 * MAX_BYTES)[:MAX_BYTES] == load_stdlib_text(MAX_BYTES)


def test_same_seed_gives_same_batch(dataset: ByteDataset) -> None:
    a = dataset.get_batch("train", 8, 32, torch.Generator().manual_seed(1337))
    b = dataset.get_batch("train", 8, 32, torch.Generator().manual_seed(1337))
    c = dataset.get_batch("train", 8, 32, torch.Generator().manual_seed(1338))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("split", ["train", "val"])
def test_batch_shapes_dtypes_and_shift(dataset: ByteDataset, split: str) -> None:
    x, y = dataset.get_batch(split, 4, 64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 64)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted left by one byte
    assert int(x.min()) >= 0 and int(x.max()) < 256 and int(y.max()) < 256


def test_storage_is_uint8_and_splits_cover_the_data(dataset: ByteDataset) -> None:
    assert dataset.train.dtype == dataset.val.dtype == torch.uint8
    assert len(dataset.val) == int(MAX_BYTES * 0.05)
    assert bytes(torch.cat([dataset.train, dataset.val]).tolist()) == load_stdlib_text(MAX_BYTES)


def test_val_windows_never_touch_train_bytes() -> None:
    # Train bytes are all < 128 and val bytes all >= 128, so any leak shows in the values.
    data = bytes(i % 128 for i in range(950)) + bytes(128 + i % 128 for i in range(50))
    ds = ByteDataset(data, val_fraction=0.05)
    assert len(ds.train) == 950 and len(ds.val) == 50
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        x, y = ds.get_batch("train", 16, 16, gen)
        assert int(torch.cat([x, y]).max()) < 128
        x, y = ds.get_batch("val", 16, 16, gen)
        assert int(torch.cat([x, y]).min()) >= 128


def test_split_too_short_for_window_is_a_clear_error() -> None:
    ds = ByteDataset(b"x" * 100, val_fraction=0.05)  # val holds 5 bytes
    with pytest.raises(ValueError, match="val split holds 5 bytes"):
        ds.get_batch("val", 2, 8, torch.Generator().manual_seed(0))


def test_encode_decode_round_trip() -> None:
    text = "def f(x):\n    return x  # naïve ✓"
    ids = encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert decode(ids) == text
    assert decode(ids.tolist()) == text
    assert decode([0xE2, 0x9C]) == "\ufffd"  # a character cut in half is replaced, not raised
