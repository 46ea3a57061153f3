"""Reasoning outputs (--reasoning-parser): the split of a whole answer, and the same split streamed
in pieces of any size."""

from __future__ import annotations

import random

import pytest

from eagle_infer.reasoning import PARSERS

CASES = {
    "<think>\nabc def</think>\n\nThe answer": (("\nabc def", "\n\nThe answer"),) * 2,
    "abc</think>xyz": (("abc", "xyz"),) * 2,  # <think> in the prompt: the answer starts inside
    "<think>only reasoning": (("only reasoning", None),) * 2,  # cut off while thinking
    "plain</think>": (("plain", None),) * 2,
    "  <think>x</think>y": (("x", "y"),) * 2,
    "no markers at all": (("no markers at all", None),) * 2,
    # qwen3: a tool call ends the reasoning and stays in the content, for the tool parser
    "<think>a<tool_call>{}</tool_call>": (("a<tool_call>{}</tool_call>", None),
                                          ("a", "<tool_call>{}</tool_call>")),
}


def streamed(parser, text: str, rng: random.Random, longest: int, thinking: bool = True) -> tuple:
    """(reasoning, content) of text fed to a ReasoningStream in pieces of 1..longest characters,
    each None where empty."""
    stream, got, i = parser.stream(thinking), ["", ""], 0
    while i < len(text):
        j = i + rng.randint(1, longest)
        for k, piece in enumerate(stream.feed(text[i:j])):
            got[k] += piece
        i = j
    for k, piece in enumerate(stream.end()):
        got[k] += piece
    return got[0] or None, got[1] or None


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_split_and_its_stream_in_pieces_of_any_size(name):
    parser = PARSERS[name]
    for text, wants in CASES.items():
        want = wants[name == "qwen3"]
        assert parser.split(text) == want, text
        assert parser.split(text, thinking=False) == (None, text)
        start, end = parser.span(text)  # where the reasoning lies (usage counts its tokens)
        assert text[start:end] == want[0] and parser.span(text, thinking=False) == (0, 0)
        for seed in range(40):  # pieces of 1-4 characters: markers cut anywhere
            assert streamed(parser, text, random.Random(seed), 4) == (want[0] or None, want[1]), (text, seed)
    assert parser.thinking({"enable_thinking": False}) == (name == "deepseek_r1")
    assert parser.thinking(None) and parser.thinking({"enable_thinking": True})


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_stream_equals_split_on_texts_made_of_marker_fragments(name):
    """Texts built from markers and their fragments (white space before them, starts that do not
    finish, implicit ends before and after the end), streamed in random pieces, thinking or not:
    the pieces add up to split()'s parts (the stream looks at each piece once)."""
    parser = PARSERS[name]
    fragments = ["<think>", "</think>", "<tool_call>", "<th", "</th", "<tool", " ", "\n", "a", "bc", "<", ">",
                 "think", "/"]
    for seed in range(2000):
        rng = random.Random(seed)
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 8)))
        for thinking in (True, False):
            want = parser.split(text, thinking)
            got = streamed(parser, text, rng, 5, thinking)
            assert got == (want[0] or None, want[1] or None), (text, thinking)
