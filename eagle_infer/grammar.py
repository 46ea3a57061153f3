"""Structured outputs: OpenAI's `response_format` (json_object, json_schema) and vLLM's
structured outputs (json, regex, choice, grammar) with xgrammar, as vLLM and SGLang do.

A request's grammar is compiled once (`Grammars.compile`) into `SamplingParams.grammar`; its
sequence gets a matcher (`new_matcher`) that accepts each token as it is emitted. Where logits are
turned into tokens, `sampling.penalize` bars what the grammar forbids (`allowed_after`): for a
verify, at every tree node, from the matcher's state after that node's drafted path (accepted,
masked, rolled back), so a node is constrained exactly as plain decoding would be after emitting
that path and speculation stays lossless. A path the grammar rejects can never be accepted (its
first forbidden token is barred at its parent), so its nodes keep an all-allowed mask.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr
from torch import Tensor

from eagle_infer.errors import UserError

KINDS = ("json", "json_schema", "regex", "choice", "grammar", "structural_tag")


class Grammars:
    """Compiles grammars for one target's tokenizer (xgrammar's compiler caches them)."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.compiler = xgr.GrammarCompiler(info)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> Grammars:
        """vocab_size: the logits' (the model's, which may exceed the tokenizer's); the grammar's
        end is one of stop_token_ids (the target's EOS)."""
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids)))

    def compile(self, kind: str, source: Any = None) -> xgr.CompiledGrammar:
        """kind json (any JSON value; source ignored), json_schema (a schema, dict or JSON text),
        regex, choice (a list of strings: the answer is one of them), grammar (EBNF / GBNF) or
        structural_tag (xgrammar's, dict or JSON text: vLLM's structured_outputs.structural_tag,
        and forced tool calls in a parser's envelope)."""
        try:
            if kind == "json":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                schema = source if isinstance(source, str) else json.dumps(source)
                return self.compiler.compile_json_schema(schema)
            if kind == "regex":
                return self.compiler.compile_regex(source)
            if kind == "choice":
                if not source or not all(isinstance(c, str) and c for c in source):
                    raise UserError("choice takes a non-empty list of non-empty strings")
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in source)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            if kind == "grammar":
                return self.compiler.compile_grammar(source)
            if kind == "structural_tag":
                text = source if isinstance(source, str) else json.dumps(source)
                return self.compiler.compile_structural_tag(text)
        except UserError:
            raise
        except Exception as e:  # xgrammar's parse errors: the request's mistake
            raise UserError(f"{kind}: {e}") from None
        raise UserError(f"unknown structured output kind {kind!r} (one of {', '.join(KINDS)})")


def new_matcher(grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(grammar)


def allowed_after(matcher: xgr.GrammarMatcher, paths: Sequence[Sequence[int]], vocab_size: int) -> Tensor:
    """The grammar's bitmask [len(paths), ceil(V / 32)] int32 of the next token after each path
    of tokens from the matcher's state (which it keeps: every path is rolled back). A finished
    grammar (its stop token accepted: the row is done, as generate() still steps it) bars nothing,
    nor does a path that ends it (a drafted stop token: nothing after it is ever accepted) or that
    it rejects (its first forbidden token is barred at its parent)."""
    bitmask = xgr.allocate_token_bitmask(len(paths), vocab_size)  # all allowed
    if matcher.is_terminated():
        return bitmask
    for j, path in enumerate(paths):
        taken = 0
        for token in path:
            if not matcher.accept_token(token):
                break
            taken += 1
        if taken == len(path) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, j)
        if taken:
            matcher.rollback(taken)
    return bitmask


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """logits [N, V] fp32 (contiguous), in place: forbidden tokens to -inf."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))

