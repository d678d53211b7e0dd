"""Text in, text out: a tiny byte-level BPE tokenizer trained here, saved beside a tiny HF
checkpoint; generation equals HF generate decoded by the same tokenizer, streamed pieces join to
the whole text (multi-byte characters too), chat templates render as HF renders them."""

import json

import pytest
from hypothesis import given, settings, strategies as st
import torch
from hf_models import CHAT_TEMPLATE, save_text_checkpoint
from mambastep.runtime.serving.detokenizer import IncrementalDetokenizer
from mambastep.runtime.engine import Engine
from mambastep.runtime.request import SamplingParams
from mambastep.runtime.serving.text import TextEngine
from mambastep.runtime.serving.tokenizer import ByteTokenizer, Tokenizer, TokenizerError

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("text")
    hf = save_text_checkpoint(path)
    hf.generation_config.eos_token_id = None
    return hf, path


def text_engine(path, **kw):
    engine = Engine.from_pretrained(path, dtype=torch.float32, device="cpu", max_context=128, **kw)
    return TextEngine(engine, Tokenizer.from_pretrained(path))


@pytest.mark.parametrize("prompt", ["the cat", "héllo 数据 🙂"])
def test_generation_equals_hf_generate_decoded(checkpoint, prompt):
    hf, path = checkpoint
    tok = Tokenizer.from_pretrained(path)
    ids = tok.encode(prompt)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    text = text_engine(path)
    rid = text.add(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    pieces, tokens = [], []
    while text.has_unfinished():
        for out in text.step():
            assert out.id == rid
            pieces.append(out.text)
            tokens += out.token_ids
    assert tokens == ref
    assert "".join(pieces) == tok.decode(ref)


def test_streamed_pieces_are_whole_characters_and_join_to_the_text(checkpoint):
    _, path = checkpoint
    tok = Tokenizer.from_pretrained(path)
    for text in ("héllo wörld 数据 和 模型 🙂🙂 ça va?", " leading space and   runs  ", "🙂"):
        ids = tok.encode(text)
        assert any(len(tok.decode([i])) == 0 or "\ufffd" in tok.decode([i]) for i in ids) or text.isascii()
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push([i]) for i in ids] + [detok.flush()]
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)


def test_chat_template_renders_as_hf(checkpoint):
    from transformers import PreTrainedTokenizerFast

    _, path = checkpoint
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  héllo  "},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "数据?"}]
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>",
                                     eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    ours = Tokenizer.from_pretrained(path)
    for gen in (True, False):
        want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ours.encode_chat(messages) == list(getattr(ids, "input_ids", ids))  # a BatchEncoding in transformers 5


def test_stop_strings_cut_the_text_and_end_the_request(checkpoint):
    _, path = checkpoint
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = text_engine(path).generate(["the cat"], greedy)[0]
    assert len(full) > 6
    stop = full[3:6]
    text = text_engine(path)
    rid = text.add("the cat", greedy, stop=[stop, "never seen \x00"])
    outs = []
    while text.has_unfinished():
        outs += text.step()
    assert "".join(o.text for o in outs) == full[: full.find(stop)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].id == rid
    assert not text.engine.requests  # the request's slot is free


def test_eos_from_the_tokenizer_stops_generation(checkpoint):
    _, path = checkpoint
    text = text_engine(path)
    rid = text.add("the cat", SamplingParams(temperature=0, max_tokens=4))
    assert text.tokenizer.eos_token_ids == (0,)
    assert 0 in text.engine.requests[rid].params.stop_token_ids


def test_bad_inputs_are_named(checkpoint, tmp_path):
    _, path = checkpoint
    text = text_engine(path)
    with pytest.raises(ValueError, match="prompt"):
        text.add(42)
    with pytest.raises(ValueError, match="stop"):
        text.add("x", stop=[""])
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ nope")
    with pytest.raises(TokenizerError, match="not a readable tokenizer"):
        Tokenizer.from_pretrained(tmp_path)
    assert not text.engine.has_unfinished()


def test_byte_fallback_round_trips_utf8():
    tok = ByteTokenizer(512)
    s = "héllo 数据 🙂"
    assert tok.decode(tok.encode(s)) == s and max(tok.encode(s)) < 256
    detok = IncrementalDetokenizer(tok)
    assert "".join([detok.push([i]) for i in tok.encode(s)] + [detok.flush()]) == s
    with pytest.raises(TokenizerError, match="256"):
        ByteTokenizer(100)


def test_tokens_that_add_no_text_keep_the_window_short():
    """A preset's ids past its bytes decode to nothing: each push stays a short decode, however
    long the stream (it was the whole stream's), and the text still comes whole."""
    detok = IncrementalDetokenizer(ByteTokenizer(50_000))
    pieces = []
    for i in range(2000):
        pieces.append(detok.push([300 + i % 40_000] if i % 50 else list("é".encode())))
        assert len(detok.ids) - detok.prefix <= detok.context + 2
    assert "".join(pieces) + detok.flush() == "é" * 40


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streamed_pieces_join_to_the_decode_of_any_ids(checkpoint, data):
    _, path = checkpoint
    tok = data.draw(st.sampled_from([Tokenizer.from_pretrained(path), ByteTokenizer(512)]))
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=30))
    prompt = tok.encode(data.draw(st.sampled_from(["", "ab", "数据 ", " x"])))  # whole characters
    detok = IncrementalDetokenizer(tok, prompt)
    joined = "".join([detok.push([i]) for i in ids] + [detok.flush()])
    context = prompt[-detok.context:]
    assert joined == tok.decode(context + ids)[len(tok.decode(context)):]


def test_chat_templates_are_found_where_hf_finds_them(checkpoint, tmp_path):
    """transformers 5's save_pretrained writes chat_template.jinja (and named templates under
    additional_chat_templates/); it wins over tokenizer_config.json's, as in HF; a processor's
    legacy chat_template.json is read where nothing else has one."""
    from transformers import PreTrainedTokenizerFast

    _, path = checkpoint
    messages = [{"role": "user", "content": "hi"}]
    other = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>",
                                     eos_token="<|endoftext|>", chat_template={"default": other, "terse": "x"})
    hf_tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 1 }}"}))
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    want = reloaded.apply_chat_template(messages, tokenize=False)
    assert want == "<<hi>>"
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages) == want
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        (tmp_path / name).unlink()
    (tmp_path / "chat_template.json").write_text('{"chat_template": "[{{ messages[0].content }}]"}')
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages) == "[hi]"
    (tmp_path / "chat_template.json").unlink()
    with pytest.raises(TokenizerError, match="no chat template .* --chat-template PATH"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages)
    given = tmp_path / "mine.jinja"
    given.write_text("({{ messages[0].content }})")
    assert Tokenizer.from_pretrained(tmp_path, given).apply_chat_template(messages) == "(hi)"


def test_generation_config_sampling_defaults_are_read(checkpoint, tmp_path):
    import shutil

    _, path = checkpoint
    shutil.copytree(path, tmp_path / "c")
    (tmp_path / "c" / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": None, "eos_token_id": [0, 1], "max_new_tokens": 9}))
    tok = Tokenizer.from_pretrained(tmp_path / "c")
    assert tok.sampling_defaults == {"temperature": 0.6, "top_p": 0.95}
    assert set(tok.eos_token_ids) >= {0, 1}
    assert ByteTokenizer(256).sampling_defaults == {}
