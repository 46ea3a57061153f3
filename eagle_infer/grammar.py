"""Structured outputs: OpenAI's `response_format` (json_object, json_schema) and vLLM's
structured outputs (json, regex, choice, grammar) with xgrammar, as vLLM and SGLang do.

A request's grammar is compiled once (`Grammars.compile`) into `SamplingParams.grammar`; its
sequence gets a matcher (`new_matcher`) that accepts each token as it is emitted. Where logits are
turned into tokens, `sampling.penalize` bars what the grammar forbids (`allowed_after`): for a
verify, at every tree node, from the matcher's state after that node's drafted path (accepted,
masked, rolled back), so a node is constrained exactly as plain decoding would be after emitting
that path and speculation stays lossless. A path the grammar rejects can never be accepted (its
first forbidden token is barred at its parent), so its nodes keep an all-allowed mask.

Where the grammar forces the next text (a tool's name, a schema's keys, a call's closing tag:
xgrammar's jump-forward string), a speculative round drafts it (`forced_tokens`, as the target's
tokenizer writes it) ahead of the head, which cannot know it; the verify decides as for any draft.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from torch import Tensor

from eagle_infer.errors import UserError

KINDS = ("json", "json_schema", "regex", "choice", "grammar", "structural_tag")

Encode = Callable[[str], list[int]]  # text -> the target tokenizer's ids, no special tokens added


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (SamplingParams.grammar) and how the target's tokenizer writes text
    (encode), with which speculative rounds draft the text the grammar forces (None: they do
    not; a spent budget's gate tokens they draft either way).
    gate: token ids after which the grammar starts (a thinking model's end of reasoning, as
    vLLM's reasoning parsers gate structured outputs); the text before them is free. budget: at
    most that many tokens before the gate (vLLM's thinking_token_budget, Anthropic's
    budget_tokens): then the gate's tokens are forced. compiled None: nothing after the gate (a
    budget alone)."""

    compiled: xgr.CompiledGrammar | None
    encode: Encode | None = None
    gate: tuple[int, ...] = ()
    budget: int | None = None


class Grammars:
    """Compiles grammars for one target's tokenizer (xgrammar's compiler caches them)."""

    def __init__(self, info: xgr.TokenizerInfo, encode: Encode | None = None):
        self.compiler = xgr.GrammarCompiler(info)
        self.encode = encode

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> Grammars:
        """vocab_size: the logits' (the model's, which may exceed the tokenizer's); the grammar's
        end is one of stop_token_ids (the target's EOS). Forced text is encoded by a copy of the
        tokenizer: the decoder's thread calls it, and a HF fast tokenizer must not run on two
        threads at once (the server's event loop encodes prompts with the original)."""
        own = copy.deepcopy(tokenizer)
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids)),
                   lambda text: own.encode(text, add_special_tokens=False))

    def compile(self, kind: str, source: Any = None) -> Grammar:
        """kind json (any JSON value; source ignored), json_schema (a schema, dict or JSON text),
        regex, choice (a list of strings: the answer is one of them), grammar (EBNF / GBNF) or
        structural_tag (xgrammar's, dict or JSON text: vLLM's structured_outputs.structural_tag,
        and forced tool calls in a parser's envelope)."""
        return Grammar(self._compile(kind, source), self.encode)

    def _compile(self, kind: str, source: Any) -> xgr.CompiledGrammar:
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


def new_matcher(grammar: Grammar) -> xgr.GrammarMatcher | GatedMatcher:
    matcher = None if grammar.compiled is None else xgr.GrammarMatcher(grammar.compiled)
    if grammar.gate:
        return GatedMatcher(matcher, grammar.gate, grammar.budget)
    if matcher is None:
        raise ValueError("a Grammar without a compiled grammar needs a gate (a budget alone)")
    return matcher


class GatedMatcher:
    """A matcher whose grammar starts once the output ends with `gate` (Grammar.gate): before,
    every token is accepted and every token allowed; from then on the inner matcher's (every
    token, without one). With a budget, once that many tokens came before the gate, only the
    gate's next token is allowed, until the gate is written (after the longest tail of those
    tokens that begins it: a gate the output had begun is finished, not restarted). The part of
    xgrammar's GrammarMatcher the decoders use (accept, rollback across the gate, masks, the
    jump-forward string), so a tree node is constrained after its drafted path as without one."""

    def __init__(self, inner: xgr.GrammarMatcher | None, gate: tuple[int, ...], budget: int | None = None):
        self.inner, self.gate, self.budget = inner, tuple(gate), budget
        self.free: list[int] = []  # the tokens before the grammar started
        self.taken: list[bool] = []  # per accepted token: whether it came after the gate
        self.started = False

    def forced(self) -> tuple[int, ...]:
        """The gate's tokens still to write where the budget has run out before the gate, else ()."""
        if self.started or self.budget is None or len(self.free) < self.budget:
            return ()
        for m in range(min(len(self.gate) - 1, len(self.free)), 0, -1):
            if tuple(self.free[-m:]) == self.gate[:m]:
                return self.gate[m:]
        return self.gate

    def accept_token(self, token: int) -> bool:
        if self.started:
            if self.inner is not None and not self.inner.accept_token(token):
                return False
            self.taken.append(True)
            return True
        forced = self.forced()
        if forced and token != forced[0]:
            return False
        self.free.append(token)
        self.taken.append(False)
        self.started = tuple(self.free[-len(self.gate):]) == self.gate
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            if self.taken.pop():
                if self.inner is not None:
                    self.inner.rollback(1)
            else:  # a free token: the grammar had not started before it
                self.free.pop()
                self.started = False

    def is_terminated(self) -> bool:
        return self.started and self.inner is not None and self.inner.is_terminated()

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int = 0) -> None:
        if self.started and self.inner is not None:
            self.inner.fill_next_token_bitmask(bitmask, index)
            return
        forced = self.forced()
        bitmask[index] = -1 if not forced else 0  # every token allowed, or only the gate's next
        if forced:
            bit = 1 << (forced[0] % 32)  # xgrammar's: bit t % 32 of int32 word t // 32
            bitmask[index, forced[0] // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit

    def find_jump_forward_string(self) -> str:
        return self.inner.find_jump_forward_string() if self.started and self.inner is not None else ""


def forced_tokens(matcher: xgr.GrammarMatcher, encode: Encode | None, limit: int) -> list[int]:
    """The text the grammar forces next from the matcher's state (xgrammar's jump-forward
    string), as encode writes it, up to `limit` tokens and the first the grammar refuses (a
    special token's text encoded as that token); the matcher keeps its state. Its last token
    may still differ from the target's, whose may reach into the free text after it. A spent
    budget's gate tokens (GatedMatcher.forced) need no encode; without one, no text is forced."""
    if limit < 1 or matcher.is_terminated():
        return []
    if isinstance(matcher, GatedMatcher) and (gate := matcher.forced()):  # a spent budget: the gate's tokens
        return list(gate[:limit])
    text = matcher.find_jump_forward_string() if encode is not None else ""
    if not text:
        return []
    tokens = []
    for token in encode(text)[:limit]:
        if not matcher.accept_token(token):
            break
        tokens.append(token)
    if tokens:
        matcher.rollback(len(tokens))
    return tokens


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
        for token in path:  # (an ended grammar is not fed: xgrammar warns at each such token)
            if matcher.is_terminated() or not matcher.accept_token(token):
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

