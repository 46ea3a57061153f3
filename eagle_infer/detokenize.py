"""Incremental detokenization: the text of a growing token list at a cost per token that does
not grow with the output (vLLM's / TGI's prefix_offset / read_offset window).

Decoding the whole output after every token costs O(n) per token, O(n^2) per request. Instead
each new token decodes a short window: the tokens from `prefix` (where the previous release's
window began) to the end, minus the text of prefix..read (what that window already released).
Starting the window a few tokens back keeps tokenizers that render a token differently at the
start of a text (SentencePiece's leading space) right, and a window whose text ends in U+FFFD
(an incomplete UTF-8 character) is held until the character completes. The first window starts
at the output's first token, so the text is exactly `tokenizer.decode(output)`.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.offsets: list[int] = []  # where each token's text starts in `text`
        self.prefix = self.read = 0  # window start; end of what the last release decoded
        self.prefix_text = ""  # decode(ids[prefix:read])

    def _decode(self, start: int, end: int) -> str:
        return self.tok.decode(self.ids[start:end], skip_special_tokens=self.skip)

    def add(self, token: int, render: bool = True) -> str:
        """Take one token; returns the text it completes ("" while held back). render False: the
        token has its place (an offset) but no text (the stop token that ends an answer: vLLM
        leaves its text out); only the last token may be one."""
        self.offsets.append(len(self.text))
        if not render:
            return ""
        self.ids.append(token)
        new_text = self._decode(self.prefix, len(self.ids))
        if len(new_text) <= len(self.prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(self.prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self._decode(self.prefix, self.read)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the output: what is still held back (an incomplete character as U+FFFD,
        as a full decode renders it)."""
        new_text = self._decode(self.prefix, len(self.ids))
        delta = new_text[len(self.prefix_text):]
        self.prefix = self.read = len(self.ids)
        self.prefix_text = ""
        self.text += delta
        return delta
