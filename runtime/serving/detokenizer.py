"""Incremental detokenization: the text of generated tokens as they come, complete UTF-8 only.

A token of a byte-level BPE can be part of a character's bytes, and a sentencepiece token's
leading space depends on the token before it, so tokens cannot be decoded one by one. Each push
decodes a short window instead: the tokens from ``prefix`` (already emitted, kept for their
context) to the end, against the same window up to ``read`` (what was emitted); the difference
is new text, emitted unless it ends in U+FFFD, the mark of a character still incomplete. A
window start is always where emitted text ended, so the pieces join to the decode of all the
tokens. Tokens that add no text at all (special tokens, a preset's ids past its bytes) are
emitted as nothing, and the window keeps only ``context`` tokens before them: a window that grew
with them made each push cost the stream's length.
"""

from __future__ import annotations

__all__ = ["IncrementalDetokenizer"]

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=(), context: int = 4):
        """tokenizer: ``decode(ids) -> str``; prompt_ids: the prompt's last few tokens give the
        first generated ones their spacing (``context`` of them)."""
        self.tokenizer, self.context = tokenizer, context
        self.ids = list(prompt_ids)[-context:] if context else []
        self.prefix = self.read = len(self.ids)
        self.start = self.read  # where generated tokens begin

    def push(self, token_ids) -> str:
        """Add generated tokens; returns the text they complete (possibly empty)."""
        self.ids += list(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if text == before:  # the new tokens add no text: emitted as nothing
            self.read = len(self.ids)
            self.prefix = max(self.prefix, self.read - self.context)
            return ""
        if len(text) <= len(before) or (text.endswith(_INCOMPLETE) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]
