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
PARSERS["deepseek-r1"] = PARSERS["deepseek_r1"]  # SGLang's name


@dataclass
class ReasoningStream:
    """One streamed answer's text routed to reasoning and content as it is released: feed() each
    piece, end() once the answer is whole. Text that could still grow into a marker is held back
    until it is known not to (or the answer ends), so the pieces add up to split()'s parts. Each
    piece is looked at once (the markers searched for in the new text only): a long reasoning
    streamed a few characters at a time costs linear time, not quadratic."""

    parser: ReasoningParser
    thinking: bool = True
    text: str = ""  # the answer so far (kept only while it may think)
    body_at: int | None = None  # where the reasoning starts (past an opening start marker), once known
    searched: int = 0  # text before this holds no whole marker
    cut: int | None = None  # where the reasoning ends, once it has
    content_at: int = 0  # where the content starts (past the end marker), once it has ended
    sent: int = 0  # text before this has been routed

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) pieces newly known for the text so far plus delta."""
        if not self.thinking:
            return "", delta
        self.text += delta
        return self._pieces(self._known())

    def end(self) -> tuple[str, str]:
        """What is still held back, once the answer is whole."""
        if not self.thinking:
            return "", ""
        if self.body_at is None:  # too short to open with the start marker: all reasoning
            self.body_at = 0
        return self._pieces(len(self.text))

    def _known(self) -> int:
        """How much of the text is routed for sure; finds the start and the end of the reasoning."""
        p, text = self.parser, self.text
        if self.body_at is None:
            opened = text.lstrip()
            if len(opened) < len(p.start) and p.start.startswith(opened):
                return 0  # it may still open with the start marker
            self.body_at = len(text) - len(opened) + len(p.start) if opened.startswith(p.start) else 0
            self.searched = self.body_at
        if self.cut is not None:
            return len(text)
        markers = [(p.end, len(p.end)), *((m, 0) for m in p.implicit_ends)]
        hits = [(i, skip) for m, skip in markers
                if (i := text.find(m, max(self.body_at, self.searched - len(m) + 1))) >= 0]
        self.searched = len(text)
        if hits:
            self.cut, skip = min(hits)
            self.content_at = self.cut + skip
            return len(text)
        return len(text) - max((k for m, _ in markers for k in range(1, len(m)) if text.endswith(m[:k])),
                               default=0)

    def _pieces(self, known: int) -> tuple[str, str]:
        """The routed text from `sent` to `known`: reasoning up to the cut, content past the end
        marker (the leading white space and start marker, and the end marker, in neither)."""
        start = max(self.sent, self.body_at or 0)
        stop = known if self.cut is None else min(known, self.cut)
        reasoning = self.text[start:stop] if stop > start else ""
        content = self.text[max(self.sent, self.content_at):known] if self.cut is not None else ""
        self.sent = max(self.sent, known)
        return reasoning, content
