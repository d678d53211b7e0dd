"""A checkpoint's tokenizer: ``tokenizer.json`` through HF ``tokenizers``, the chat template
(found where HF finds it) rendered with jinja2 the way HF renders it, the sampling defaults of
``generation_config.json``, and a byte-level fallback for presets, which have random weights and
no tokenizer."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

__all__ = ["ByteTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]


class TokenizerError(ValueError):
    """A tokenizer file is missing or unreadable, or a chat template fails; the message names it."""


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# generation_config.json's fields that set a request's sampling where it names none (as vLLM does)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k")


class Tokenizer:
    """encode / decode over HF ``tokenizers``; ``eos_token_ids``: every id that ends a generation
    (the config's EOS token, and the checkpoint's generation_config.json ones);
    ``sampling_defaults``: generation_config.json's temperature, top_p and top_k."""

    def __init__(self, backend, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: tuple[int, ...] = (), source: str = "tokenizer",
                 sampling_defaults: dict | None = None):
        self.backend, self.chat_template, self.source = backend, chat_template, source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.sampling_defaults = dict(sampling_defaults or {})
        ids = set(eos_token_ids)
        if eos_token is not None and backend.token_to_id(eos_token) is not None:
            ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids = tuple(sorted(ids))
        # the most characters one token's string spells: a text past max_context of them cannot fit
        self.max_token_chars = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | Path | None = None) -> "Tokenizer":
        """tokenizer.json and, when present, tokenizer_config.json, the chat template files and
        generation_config.json; ``chat_template``: a template file that takes their place (the
        template itself, or a JSON object with a "chat_template" field)."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"{file}: missing (the checkpoint has no tokenizer.json)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:  # tokenizers raises a plain Exception on a bad file
            raise TokenizerError(f"{file}: not a readable tokenizer ({e})") from None
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        eos = generation.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        template = _template_file(Path(chat_template)) if chat_template is not None else _find_template(path, config)
        defaults = {k: generation[k] for k in SAMPLING_DEFAULTS if generation.get(k) is not None}
        return cls(backend, chat_template=template, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), eos_token_ids=eos_ids, source=str(path),
                   sampling_defaults=defaults)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat rendered as text, as HF's ``apply_chat_template(..., tokenize=False)``."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: no chat template (none in chat_template.jinja, tokenizer_config.json "
                                 "or chat_template.json); give one with --chat-template PATH")
        try:
            return _compiled(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TokenizerError:
            raise
        except Exception as e:  # a template error (jinja2's own, or one the template raises)
            raise TokenizerError(f"{self.source}: chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat's prompt ids: the template writes its own special tokens, so none are added."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class ByteTokenizer:
    """Text as UTF-8 bytes, one id a byte: a stand-in for presets, whose vocabularies are at least
    256 and have no tokenizer. Ids from 256 up decode to nothing."""

    chat_template = None
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict = {}
    max_token_chars = 1
    source = "the byte-level fallback"

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise TokenizerError(f"vocab_size {vocab_size}: the byte-level fallback needs at least 256 ids")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def load_tokenizer(path: str | Path | None, vocab_size: int, chat_template: str | Path | None = None):
    """The checkpoint's tokenizer at ``path``, or the byte-level fallback without one;
    ``chat_template``: a template file in place of the checkpoint's (needs a tokenizer)."""
    if path is not None and (Path(path) / "tokenizer.json").exists():
        return Tokenizer.from_pretrained(path, chat_template)
    if chat_template is not None:
        raise TokenizerError(f"--chat-template: needs the checkpoint's tokenizer.json ({path or 'a preset'} has none)")
    return ByteTokenizer(vocab_size)


def _find_template(path: Path, config: dict) -> str | None:
    """The default chat template where HF looks for it: chat_template.jinja (transformers 5
    writes it there) or additional_chat_templates/default.jinja, before tokenizer_config.json's
    chat_template (a string, or named templates of which HF takes "default"); then the legacy
    chat_template.json that processors write."""
    for file in (path / "chat_template.jinja", path / "additional_chat_templates" / "default.jinja"):
        if file.exists():
            return _template_file(file)
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is None and (path / "chat_template.json").exists():
        template = _template_file(path / "chat_template.json")
    return template


def _template_file(file: Path) -> str:
    """A chat template from a file: the template itself, or JSON with a "chat_template" field."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{file}: unreadable chat template ({e})") from None
    if file.suffix == ".json":
        try:
            template = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            template = None
        if not isinstance(template, str):
            raise TokenizerError(f"{file}: expected a JSON object with a \"chat_template\" string")
        return template
    return text


def _read_json(file: Path) -> dict:
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return data


_templates: dict[str, object] = {}


def _compiled(source: str):
    """A chat template compiled as HF compiles them: a sandbox, trim_blocks and lstrip_blocks, loop
    controls, ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII."""
    if source not in _templates:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _templates[source] = env.from_string(source)
    return _templates[source]
