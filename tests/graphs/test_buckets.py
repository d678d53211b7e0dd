"""Bucket sets: which static step shapes get a graph, and which one a step uses."""

import pytest

from mambastep.graphs import Bucket, BucketSet

BUCKETS = BucketSet(decode=(1, 4, 8), mixed_decode=(0, 4, 8), prefill=(32, 64), max_prefill_seqs=4)


def test_bucket_choice():
    assert BUCKETS.choose(5, 33, 1) == Bucket(8, 64)
    assert BUCKETS.choose(3) == Bucket(4)
    assert BUCKETS.choose(9) is None
    assert BUCKETS.choose(8) == Bucket(8)  # sizes are inclusive
    assert BUCKETS.choose(4, 32, 1) == Bucket(4, 32)
    assert BUCKETS.choose(0, 10, 5) is None  # more than 4 sequences
    assert BUCKETS.choose(0, 65, 1) is None and BUCKETS.choose(9, 1, 1) is None
    order = BUCKETS.all()
    assert order[0] == Bucket(8, 64) and sorted(order, reverse=True, key=lambda b: b.decode + b.prefill) == order


def test_bucket_fits():
    assert Bucket(4, 32).fits(4, 32, 4, max_prefill_seqs=4)
    assert not Bucket(4, 32).fits(4, 32, 5, max_prefill_seqs=4)
    assert not Bucket(4).fits(1, 1, 1, max_prefill_seqs=4)  # a decode-only bucket takes no prefill
    assert not Bucket(4, 32).fits(5, 0, 0, max_prefill_seqs=4)


def test_bucket_set_round_trips(tmp_path):
    BUCKETS.save(tmp_path / "b.json")
    assert BucketSet.load(tmp_path / "b.json") == BUCKETS
    with pytest.raises(ValueError, match="decode"):
        BucketSet(decode=(0, 4))


def test_defaults():
    assert BucketSet.default(cuda=True) == BucketSet()
    cpu = BucketSet.default(cuda=False)
    assert cpu.max_decode == 16 and cpu.max_prefill_tokens == 512
