"""SamplingParams: what a request may ask for, checked on the way in."""

import pytest

from mambastep.runtime.request import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "1"), ("top_k", -1), ("top_k", 2.0), ("top_k", True), ("top_p", 0.0),
    ("top_p", 1.01), ("top_p", float("nan")), ("seed", 2**63), ("seed", 1.5), ("max_tokens", 0),
    ("max_tokens", 3.0), ("stop_token_ids", (1, -2)), ("stop_token_ids", 5), ("ignore_eos", 1),
])
def test_params_reject_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_tokens) == (1.0, 0, 1.0, None, 16)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    with pytest.raises(AttributeError):
        p.temperature = 0.5
    hash(SamplingParams(stop_token_ids=[1]))
