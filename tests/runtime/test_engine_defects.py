"""Defects found by trying the Engine as a new user would; each test holds one fixed.

(tests/runtime/test_engine_machine.py is the state machine that looks for more.)"""

import json

import pytest
import torch

from hf_models import save_tiny
from mambastep.runtime.config import ConfigError
from mambastep.runtime.engine import Engine, SamplingParams
from mambastep.runtime.model import Model
from mambastep.runtime.weights import WeightError


def tiny_engine(**kw):
    return Engine.from_preset("tiny-hybrid", dtype=torch.float32, device="cpu", **kw)


def test_pipelined_draws_with_the_default_modes_positions():
    """Pipelined mode read a draw's position from the tokens collected, one behind: positions
    ran 0, 0, 1, 2, ... and the first two tokens shared their noise."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    default = tiny_engine().generate([[1, 2, 3]], params)
    assert default == tiny_engine(pipelined=True).generate([[1, 2, 3]], params)
    assert default == [[37, 335, 194, 214, 213, 504, 117, 236]]


@pytest.mark.parametrize("pipelined", [False, True])
def test_max_context_bounds_prompt_plus_output(pipelined):
    """Pipelined mode stopped one token early (it read ``computed``, already advanced by the
    step in flight); prompt plus output tokens now fill max_context exactly, in both modes."""
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine = tiny_engine(max_context=40, pipelined=pipelined)
    assert [len(t) for t in engine.generate([list(range(1, 31)), list(range(1, 40))], greedy)] == [10, 1]


@pytest.mark.parametrize("pipelined", [False, True])
def test_generate_keeps_other_requests_outputs(pipelined):
    """generate() steps the whole engine; a request added before it finished inside it and its
    tokens were lost. They come out of the next step() now, once, complete."""
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = tiny_engine().generate([[9, 8, 7]], p)[0]
    engine = tiny_engine(pipelined=pipelined)
    a = engine.add_request([9, 8, 7], p)
    assert engine.generate([[4, 5]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert engine.has_unfinished()
    outs = engine.step()
    assert [(o.id, o.new_tokens, o.finished, o.finish_reason) for o in outs] == [(a, alone, True, "length")]
    assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize("bad, match", [
    ([[1, 2], [3]], "flat list"), ([[1, 2], [3, 4]], r"shape \[2, 2\]"), ([], "non-empty"),
])
def test_ragged_and_nested_prompts_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine().add_request(bad)


@pytest.fixture
def checkpoint(tmp_path):
    save_tiny("nemotron_h", tmp_path)
    return tmp_path


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage", None], ids=["empty", "garbage", "truncated"])
def test_unreadable_safetensors_is_a_weight_error_naming_the_file(checkpoint, content):
    path = checkpoint / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if content is None else content)
    with pytest.raises(WeightError, match="model.safetensors"):
        Model.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.mark.parametrize("text, match", [
    ("", "not valid JSON"), ("{ nope", "not valid JSON"), ("[1, 2]", "JSON object"),
])
def test_unreadable_config_is_a_config_error_naming_the_file(checkpoint, text, match):
    (checkpoint / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=f"config.json: .*{match}"):
        Model.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.mark.parametrize("field, value", [
    ("time_step_limit", [0.1]), ("layer_norm_epsilon", "x"), ("vocab_size", "512"), ("hidden_size", 64.5),
])
def test_bad_config_fields_are_named_before_any_step(checkpoint, field, value):
    config = json.loads((checkpoint / "config.json").read_text())
    config[field] = value
    if field == "time_step_limit":  # Mamba2's field: read the checkpoint as a Mamba2 one
        save_tiny("mamba2", checkpoint)
        config = {**json.loads((checkpoint / "config.json").read_text()), field: value}
    (checkpoint / "config.json").write_text(json.dumps(config))
    name = {"layer_norm_epsilon": "norm_eps", "time_step_limit": "time_step_limit"}.get(field, field)
    with pytest.raises(ConfigError, match=name):
        Model.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.mark.parametrize("pipelined", [False, True])
def test_no_output_after_abort_even_one_generate_held(pipelined):
    """Found by the state machine: a request's tokens that a generate() call held for it came out
    of the next step() after the request was aborted."""
    engine = tiny_engine(pipelined=pipelined)
    a = engine.add_request([0], SamplingParams(temperature=0, max_tokens=2))
    engine.generate([[0]], SamplingParams(temperature=0.7, seed=0, max_tokens=1))
    engine.abort(a)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert all(o.id != a for o in outs)
