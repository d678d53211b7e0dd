"""`mambastep generate`: a checkpoint's text streamed to standard output."""

import pytest

from hf_models import save_text_checkpoint
from mambastep.tools import cli


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate")
    save_text_checkpoint(path)
    return path


def test_generate_prints_the_text_the_engine_makes(checkpoint, capsys):
    import torch

    from mambastep.runtime.engine import Engine
    from mambastep.runtime.request import SamplingParams
    from mambastep.runtime.serving.text import TextEngine
    from mambastep.runtime.serving.tokenizer import Tokenizer

    assert cli.main(["generate", "--model", str(checkpoint), "--device", "cpu", "--max-tokens", "12", "héllo"]) == 0
    out, err = capsys.readouterr()
    engine = Engine.from_pretrained(checkpoint, dtype=torch.float32, device="cpu", max_context=4096)
    want = TextEngine(engine, Tokenizer.from_pretrained(checkpoint)).generate(
        ["héllo"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out == want + "\n"
    assert "tokens/s" in err


def test_generate_chat_and_errors(checkpoint, capsys):
    assert cli.main(["generate", "--model", str(checkpoint), "--device", "cpu", "--chat", "--system", "be brief",
                     "--max-tokens", "4", "hi"]) == 0
    assert "finished" in capsys.readouterr().err
    for argv, match in ((["--system", "x", "hi"], "--system: goes with --chat"),
                        (["--chat-template", "t.jinja", "hi"], "--chat-template: goes with --chat"),
                        (["--chat", "--chat-template", str(checkpoint / "none.jinja"), "hi"], "is not a file"),
                        (["--max-tokens", "0", "hi"], "max_tokens"),
                        (["--stop", "", "hi"], "--stop")):
        with pytest.raises(SystemExit):
            cli.main(["generate", "--model", str(checkpoint), "--device", "cpu", *argv])
        assert match in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(checkpoint / "missing"), "--device", "cpu", "hi"])
    assert "config.json: not found" in capsys.readouterr().err


def test_generate_on_a_preset_uses_bytes(capsys):
    assert cli.main(["generate", "--preset", "tiny-hybrid", "--device", "cpu", "--max-tokens", "3", "hi"]) == 0
    assert "3 tokens" in capsys.readouterr().err


def test_generate_takes_a_chat_template_file_and_the_checkpoint_sampling_defaults(checkpoint, tmp_path, capsys):
    """--chat-template replaces the checkpoint's; generation_config.json's temperature samples
    where no option is given (a seeded draw, as the engine makes it), and --temperature 0 wins."""
    import dataclasses
    import json
    import shutil

    import torch

    from mambastep.runtime.engine import Engine
    from mambastep.runtime.request import SamplingParams

    shutil.copytree(checkpoint, tmp_path / "c")
    (tmp_path / "c" / "generation_config.json").write_text(json.dumps({"temperature": 5.0, "top_k": 50}))
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }} and more")
    argv = ["generate", "--model", str(tmp_path / "c"), "--device", "cpu", "--max-tokens", "12", "--seed", "3"]
    outs = []
    for extra in ([], ["--temperature", "0"]):
        assert cli.main([*argv, *extra, "--chat", "--chat-template", str(template), "the cat"]) == 0
        outs.append(capsys.readouterr().out)
    from mambastep.runtime.serving.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tmp_path / "c")
    ids = tok.encode("the cat and more", add_special_tokens=False)
    engine = Engine.from_pretrained(tmp_path / "c", dtype=torch.float32, device="cpu", max_context=4096)
    stop = tuple(tok.eos_token_ids)
    for out, params in zip(outs, (SamplingParams(temperature=5.0, top_k=50, seed=3, max_tokens=12),
                                  SamplingParams(temperature=0, seed=3, max_tokens=12))):
        tokens = engine.generate([ids], dataclasses.replace(params, stop_token_ids=stop))[0]
        assert out == tok.decode(tokens) + "\n"
    assert outs[0] != outs[1]
