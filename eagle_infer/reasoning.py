"""Reasoning outputs (vLLM's `--reasoning-parser`): a thinking model's chat answer split into its
`reasoning`, the text between `<think>` and `</think>`, and its `content`, the text after, as
vLLM's chat completions answer (`message.reasoning` / `delta.reasoning`, the field vLLM named
`reasoning_content` before 0.26).

As vLLM's parsers: a leading `<think>` is dropped (Qwen3's and DeepSeek-R1's templates may put it
in the prompt instead, so the answer starts inside the reasoning); an answer without `</think>`
is reasoning alone (content null); text after `</think>`, if any, is the content. qwen3 also
ends the reasoning at a `<tool_call>` (the call is content, for the tool parser), and with
`chat_template_kwargs.enable_thinking` false the whole answer is content.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    implicit_ends: tuple[str, ...] = ()  # text that ends the reasoning and stays in the content

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether a request's answer starts in its reasoning: qwen3's enable_thinking false turns
        it off (vLLM's); deepseek_r1 always thinks."""
        return not (self.name == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False)

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None for a part it does not have."""
        if not thinking:
            return None, text
        body = self._body(text)
        cut, skip = self._end(body)
        if cut < 0:
            return body, None
        return body[:cut], body[cut + skip:] or None

    def span(self, text: str, thinking: bool = True) -> tuple[int, int]:
        """Where the reasoning lies in a whole answer: [start, end) character offsets (empty
        without it), for counting its tokens (usage's completion_tokens_details)."""
        if not thinking:
            return 0, 0
        body = self._body(text)
        start = len(text) - len(body)
        cut, _ = self._end(body)
        return start, start + (len(body) if cut < 0 else cut)

    def _body(self, text: str) -> str:
        """text without the start marker it opens with (after white space), if it does."""
        opened = text.lstrip()
        return opened[len(self.start):] if opened.startswith(self.start) else text

    def _end(self, body: str) -> tuple[int, int]:
        """Where the reasoning ends in body (-1: it has not) and the length of the marker that ends
        it (0 for an implicit end, which stays in the content)."""
        hits = [(i, len(self.end)) for i in [body.find(self.end)] if i >= 0]
        hits += [(i, 0) for i in (body.find(m) for m in self.implicit_ends) if i >= 0]
        return min(hits) if hits else (-1, 0)

    def stream(self, thinking: bool = True) -> ReasoningStream:
        return ReasoningStream(self, thinking)


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1"),
    "qwen3": ReasoningParser("qwen3", implicit_ends=("<tool_call>",)),
}


@dataclass
class ReasoningStream:
    """One streamed answer's text routed to reasoning and content as it is released: feed() each
    piece, end() once the answer is whole. Text that could still grow into a marker is held back
    until it is known not to (or the answer ends), so the pieces add up to split()'s parts."""

    parser: ReasoningParser
    thinking: bool = True
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) pieces newly known for the text so far plus delta."""
        self.text += delta
        return self._pieces(self.text[:len(self.text) - self._held()])

    def end(self) -> tuple[str, str]:
        """What is still held back, once the answer is whole."""
        return self._pieces(self.text)

    def _held(self) -> int:
        """Length of the text's end that could grow into a marker that still matters."""
        p, text = self.parser, self.text
        if not self.thinking:
            return 0
        opened = text.lstrip()
        if len(opened) < len(p.start) and p.start.startswith(opened):
            return len(text)  # it may still open with the start marker
        if p._end(p._body(text))[0] >= 0:
            return 0  # the reasoning has ended: the rest is content
        markers = [p.end, *p.implicit_ends]
        return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)

    def _pieces(self, text: str) -> tuple[str, str]:
        reasoning, content = self.parser.split(text, self.thinking)
        reasoning, content = reasoning or "", content or ""
        r, c = reasoning[self.reasoning_sent:], content[self.content_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(content))
        return r, c
