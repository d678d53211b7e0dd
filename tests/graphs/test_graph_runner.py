"""The graph runner knows nothing of models: a toy step over static buffers, eager on the CPU,
captured and replayed on CUDA, equal either way."""

import pytest
import torch

from mambastep.graphs import Bucket, BucketSet, GraphRunner


class ToyStep:
    """A host buffer copied to a device twin; forward sums a bucket's prefix of it into rows,
    the tail scales them by the variant."""

    def __init__(self, device, n=16):
        self.host = torch.zeros(n, pin_memory=device.type == "cuda")
        self.dev = self.host if device.type == "cpu" else torch.zeros(n, device=device)
        self.uploads = 0
        self.runner = GraphRunner(self.forward, self.tail, (1, 10), self.upload, device)

    def upload(self):
        self.uploads += 1
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)

    def forward(self, bucket: Bucket) -> torch.Tensor:
        return self.dev[: bucket.decode].cumsum(0)

    def tail(self, bucket: Bucket, x: torch.Tensor, variant) -> torch.Tensor:
        return x * variant

    def step(self, values, bucket, variant):
        self.host.zero_()
        self.host[: len(values)] = torch.tensor(values, dtype=torch.float32)
        x = self.runner.forward(bucket)
        return self.runner.tail(bucket, x, variant).clone()


def expected(values, bucket, variant):
    padded = torch.zeros(bucket.decode)
    padded[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return padded.cumsum(0) * variant


def test_eager_runs_the_stages_with_one_upload_each():
    toy = ToyStep(torch.device("cpu"))
    assert torch.equal(toy.step([1, 2, 3], Bucket(4), 10), expected([1, 2, 3], Bucket(4), 10))
    assert toy.uploads == 1 and toy.runner.graphs == 0
    with pytest.raises(RuntimeError, match="CUDA"):
        toy.runner.capture([Bucket(4)], prepare=lambda b: None, progress=False)


@pytest.mark.gpu
def test_replays_see_refilled_buffers_and_uncaptured_buckets_run_eagerly():
    toy = ToyStep(torch.device("cuda"))
    buckets = BucketSet(decode=(2, 8), mixed_decode=(0,), prefill=(16,), max_prefill_seqs=1)
    captured = [b for b in buckets.all() if not b.prefill]
    report = toy.runner.capture(captured, prepare=lambda b: toy.host.zero_(), progress=False)
    assert report.graphs == 2 * (1 + 2) and toy.runner.captured(Bucket(8)) and not toy.runner.captured(Bucket(4))
    uploads = toy.uploads
    for values, bucket in (([5, 7], Bucket(2)), ([1, 2, 3, 4, 5], Bucket(8)), ([9, 1], Bucket(8))):
        for variant in (1, 10):
            got = toy.step(values, bucket, variant)
            assert torch.equal(got.cpu(), expected(values, bucket, variant))
    assert toy.uploads == uploads  # a replay's upload is a node of its graph
    got = toy.step([3, 3, 3], Bucket(4), 1)  # not captured: eager, uploading itself
    assert torch.equal(got.cpu(), expected([3, 3, 3], Bucket(4), 1)) and toy.uploads == uploads + 1
