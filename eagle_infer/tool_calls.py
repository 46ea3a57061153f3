"""Tool calling in chat completions: OpenAI's `tools` and `tool_choice`, answered as vLLM does.

- a named function (`tool_choice: {"type": "function", "function": {"name": ...}}`): one call of
  it (finish_reason "stop", as OpenAI's and vLLM's);
- "required": one or more calls of any of the tools (one with `parallel_tool_calls: false`;
  finish_reason "tool_calls");
- "auto": the model decides; a tool-call parser (`--tool-call-parser`, vLLM's hermes,
  llama3_json, pythonic, phi4_mini_json or mistral format) finds the calls in its text, what comes
  before them is the content;
- "none": tools are only shown to the chat template.

Forced calls (named, "required") are decoded under a grammar (grammar.py), so they are exact
under speculation like any other structured output. With a parser whose format has an envelope
(hermes), the model writes them in it, as vLLM 0.32 has it write them: `<tool_call>{"name":
"f", "arguments": ...}</tool_call>` tags (xgrammar's structural tag, vLLM's two forms); without,
as vLLM did before: a named call's arguments as bare JSON, "required" as a JSON list of {"name",
"parameters"} (`required_schema`). Either way the arguments follow the function's `parameters`
schema unless the tool says `"strict": false` (vLLM 0.32 pins them only for `"strict": true`).
Where a tool says `"strict": true`, "auto" answers are decoded under a grammar too (vLLM 0.32's):
free text, but a call, once its envelope begins, in the envelope around its tool's schema.
Streaming, an "auto" answer streams its content up to where a call starts; a call in hermes'
envelope (auto or forced), llama3_json's or Mistral's `name{` ("auto") streams as vLLM's parsers
stream it: its id and name once `{"name": ..., "arguments": ` (or Mistral's head) is written, then
its arguments as the model writes them, in json.dumps' form (the pieces add up to the whole
answer's arguments); a bare named call's arguments stream as the text does; other calls
("required" without an envelope, a call not written in that order) come whole at the end.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (content or None, [(name, arguments as JSON text)]); no calls: the whole text as content
Parsed = tuple[str | None, list[tuple[str, str]]]

HERMES_START = "<tool_call>"
HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
LLAMA_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's
PHI4_START = "functools["
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)(\[ARGS\])?\s*")


def parse_hermes(text: str) -> Parsed:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more (the
    last may lack its closing tag); the content is the text before the first. A call that does
    not parse leaves the whole text as content (vLLM's hermes parser)."""
    if HERMES_START not in text:
        return text, []
    try:
        calls = []
        for m in HERMES_CALL.finditer(text):
            obj = json.loads(m[1] if m[1] is not None else m[2])
            calls.append((obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    except (ValueError, KeyError, TypeError):
        return text, []
    return text[: text.find(HERMES_START)] or None, calls


def parse_llama3_json(text: str) -> Parsed:
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` objects (or "arguments"),
    optionally after `<|python_tag|>`, several separated by `;`; calls leave no content. Any
    object that does not parse, or lacks a name, leaves the whole text as content (vLLM's
    llama3_json parser)."""
    if LLAMA_TAG not in text and "{" not in text:
        return text, []
    decoder, calls, end = json.JSONDecoder(), [], -1
    try:
        for m in re.finditer(r"\{", text):
            if m.start() <= end:  # inside an object already read
                continue
            obj, length = decoder.raw_decode(text[m.start():])
            end = m.start() + length
            args = obj["arguments"] if "arguments" in obj else obj["parameters"]
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
    except (ValueError, KeyError, TypeError):
        return text, []
    return (None, calls) if calls else (text, [])


def parse_pythonic(text: str) -> Parsed:
    """Llama 3.2 / 4's pythonic calls (vLLM's pythonic and llama4_pythonic parsers): the whole
    answer a Python list of calls by keyword, `[get_weather(city="Paris"), get_time()]`, within
    Llama 4's python tags or not; each argument a literal (JSON's values, Python's spelling of
    them: True, None); calls leave no content. Anything else (a positional argument, a value that
    is not a literal, text around the list) leaves the whole text as content. Parsed, not run."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        listed = ast.parse(body, mode="eval").body
        if not (isinstance(listed, ast.List) and listed.elts):
            return text, []
        calls = []
        for call in listed.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
                    and all(k.arg for k in call.keywords)):
                return text, []
            args = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append((call.func.id, json.dumps(args, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # TypeError: a set, bytes
        return text, []
    return None, calls


def parse_phi4_mini_json(text: str) -> Parsed:
    """Phi-4-mini's calls (vLLM's phi4_mini_json parser): `functools[{"name": ..., "arguments":
    {...}}, ...]` (or "parameters"); the content is the text before it. A list that does not parse
    (read as JSON to its end, nested brackets and all) leaves the whole text as content."""
    at = text.find(PHI4_START)
    if at < 0:
        return text, []
    try:
        items, _ = json.JSONDecoder().raw_decode(text, at + len(PHI4_START) - 1)
        calls = [(c["name"], json.dumps(c["arguments"] if "arguments" in c else c["parameters"],
                                        ensure_ascii=False)) for c in items]
    except (ValueError, KeyError, TypeError):
        return text, []
    return (text[:at] or None, calls) if calls else (text, [])


def parse_mistral(text: str) -> Parsed:
    """Mistral's calls (vLLM's mistral parser), each after the `[TOOL_CALLS]` token, in the
    tokenizer's format: a JSON list of {"name", "arguments"} (before v11: Mistral 7B v0.3),
    `name{...}` (v11: Mistral Small 3) or `name[ARGS]{...}` (v13); the text before the first
    is the content. A call that does not parse leaves the whole text as content."""
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return text, []
    decoder, calls = json.JSONDecoder(), []
    try:
        for piece in text[at + len(MISTRAL_TAG):].split(MISTRAL_TAG):
            body = piece.strip()
            if body.startswith("["):
                items, _ = decoder.raw_decode(body)
                calls += [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items]
                continue
            name = MISTRAL_NAME.match(body)
            if name is None or not body[name.end():].startswith("{"):
                return text, []
            args, _ = decoder.raw_decode(body, name.end())
            if not isinstance(args, dict):
                return text, []
            calls.append((name[1], json.dumps(args, ensure_ascii=False)))
    except (ValueError, KeyError, TypeError):
        return text, []
    return (text[:at] or None, calls) if calls else (text, [])


def tag_content_end(tag: str) -> Callable[[str], int]:
    """Streaming, for a format whose calls start at `tag`: how much of the text is content for
    certain: up to the tag, less an end that could still grow into it."""
    def content_end(text: str) -> int:
        at = text.find(tag)
        if at >= 0:
            return at
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                return len(text) - k
        return len(text)
    return content_end


hermes_content_end = tag_content_end(HERMES_START)


def calls_first_content_end(opening: str, tag: str) -> Callable[[str], int]:
    """Streaming, for a format whose calls are the whole answer: one that starts as calls
    (`opening`, or `tag`, after whitespace) may be all calls, so none of it is content until it
    ends; any other answer is content."""
    def content_end(text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith(opening) or head.startswith(tag) or tag.startswith(head):
            return 0
        return len(text)
    return content_end


llama3_content_end = calls_first_content_end("{", LLAMA_TAG)
pythonic_content_end = calls_first_content_end("[", PYTHON_START)


def call_head(keys: str) -> tuple[re.Pattern, re.Pattern]:
    """Streaming: a call's head, `{"name": "...", "<key>": ` up to where its arguments begin (its
    name the group), and text past where a head would have matched (the key's value begun)."""
    return (re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + keys + r')"\s*:\s*'),
            re.compile(r'"(?:' + keys + r')"\s*:\s*\S'))


HERMES_HEAD, LLAMA3_HEAD = call_head("arguments"), call_head("arguments|parameters")
# next_call's answers: a call's (name, where its arguments begin); WAIT: not yet known; WHOLE:
# a call not in the streamed form (it and the rest come whole at the end)
WAIT, WHOLE = "wait", "whole"
Head = tuple[str, int] | str


def head_at(text: str, at: int, pattern: tuple[re.Pattern, re.Pattern]) -> Head:
    """The call whose head (`pattern`: call_head's) starts at `at`, its arguments an object, or
    WAIT / WHOLE."""
    rest = text[at:]
    head = pattern[0].match(rest)
    if head is None:
        return WHOLE if pattern[1].search(rest) else WAIT
    if head.end() == len(rest):  # the arguments' value has not begun
        return WAIT
    try:
        name = json.loads(f'"{head[1]}"')
    except ValueError:
        return WHOLE
    return (name, at + head.end()) if rest[head.end()] == "{" and name else WHOLE


def hermes_next_call(text: str, pos: int) -> Head:
    """Streaming: the next call's head past `pos` (after the last call's arguments): in a tag."""
    at = text.find(HERMES_START, pos)
    if at < 0:
        return WAIT
    found = head_at(text, at + len(HERMES_START), HERMES_HEAD)
    return WHOLE if found == WAIT and HERMES_START in text[at + 1:] else found


def llama3_next_call(text: str, pos: int) -> Head:
    """Streaming: the next call's head past `pos`: the answer's first object (after whitespace and
    the python tag), then each one after a `;`; anything else is not a call (the whole parse
    decides)."""
    rest = text[pos:].lstrip()
    if pos == 0 and rest.startswith(LLAMA_TAG):
        rest = rest[len(LLAMA_TAG):].lstrip()
    elif pos == 0 and LLAMA_TAG.startswith(rest):
        return WAIT
    elif pos > 0 and rest:
        if rest[0] != ";":
            return WHOLE
        rest = rest[1:].lstrip()
    if not rest:
        return WAIT
    return head_at(text, len(text) - len(rest), LLAMA3_HEAD) if rest[0] == "{" else WHOLE


def mistral_next_call(text: str, pos: int) -> Head:
    """Streaming: the next call's head past `pos`: `[TOOL_CALLS]name{` or `[TOOL_CALLS]name[ARGS]{`
    (its arguments then stream); a JSON list after the token (the format before v11) is WHOLE."""
    at = text.find(MISTRAL_TAG, pos)
    if at < 0:
        return WAIT
    start = at + len(MISTRAL_TAG)
    rest = text[start:]
    if not rest.strip():
        return WAIT
    name = MISTRAL_NAME.match(rest)
    if rest.lstrip().startswith("[") or name is None:
        return WHOLE
    after = rest[name.end():]
    if after.startswith("{"):
        return name[1], start + name.end()
    if not after or (not name[2] and MISTRAL_ARGS.startswith(after)):  # the head still being written
        return WAIT
    return WHOLE


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """Mistral's templates take only call ids of 9 letters and digits (vLLM's mistral ids)."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def mistral_history_id(call_id: str) -> str:
    """A call id in a request's history as Mistral's templates take it: an id of more than 9
    characters (another server's, "call_..." or "chatcmpl-tool-...") cut to its last 9, as vLLM
    cuts them for Mistral models, so a conversation begun elsewhere goes on here; the calls and
    the tool turns answering them are cut alike, so they still pair."""
    return call_id[-9:]


@dataclass(frozen=True)
class Parser:
    parse: Callable[[str], Parsed]
    content_end: Callable[[str], int]
    # the forms of one call, (text before the function's name, text after its arguments), a
    # forced call is written in; none: forced calls are bare JSON
    envelope: tuple[tuple[str, str], ...] = ()
    # streaming: the next call's head past a position (hermes_next_call), whose arguments then
    # stream (ToolStream); None: calls come whole at the end
    next_call: Callable[[str, int], Head] | None = None
    call_id: Callable[[], str] = tool_call_id  # a new call's id
    history_id: Callable[[str], str] | None = None  # a history's call ids as the template takes them


def history_ids(messages: list[dict[str, Any]], history_id: Callable[[str], str]) -> list[dict[str, Any]]:
    """messages (Message.for_template's) with each assistant call's id and each tool turn's
    tool_call_id through history_id."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = m | {"tool_calls": [c | {"id": history_id(c["id"])} if isinstance(c.get("id"), str) else c
                                    for c in m["tool_calls"]]}
        if isinstance(m.get("tool_call_id"), str):
            m = m | {"tool_call_id": history_id(m["tool_call_id"])}
        out.append(m)
    return out


ARGUMENTS_AFTER_NAME = '", "arguments": '
HERMES_ENVELOPE = (('<tool_call>\n{"name": "', "}\n</tool_call>"), ('<tool_call>{"name": "', "}</tool_call>"))
PARSERS = {"hermes": Parser(parse_hermes, hermes_content_end, HERMES_ENVELOPE, hermes_next_call),
           "llama3_json": Parser(parse_llama3_json, llama3_content_end, next_call=llama3_next_call),
           "pythonic": Parser(parse_pythonic, pythonic_content_end),
           "phi4_mini_json": Parser(parse_phi4_mini_json, tag_content_end(PHI4_START)),
           "mistral": Parser(parse_mistral, tag_content_end(MISTRAL_TAG), next_call=mistral_next_call,
                             call_id=mistral_call_id, history_id=mistral_history_id)}
PARSERS["llama4_pythonic"] = PARSERS["pythonic"]  # vLLM's two names; the one parser reads Llama 4's tags
# SGLang's names for the same formats: qwen25 and qwen (Qwen's <tool_call> tags, hermes'), llama3
PARSERS |= {"qwen25": PARSERS["hermes"], "qwen": PARSERS["hermes"], "llama3": PARSERS["llama3_json"]}


def call_object(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    """A message's tool call (OpenAI's shape; a streamed delta's adds its "index")."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parameters_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """What a function's arguments must be: its parameters schema (vLLM's stand-in where it has
    none), any object where the tool says "strict": false."""
    if fn.get("strict") is False:
        return {"type": "object"}
    return fn.get("parameters") or {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema of a "required" answer: a non-empty list of {"name", "parameters"} objects,
    each one of the tools' (their `$defs` gathered at the top)."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        fn = tool["function"]
        params = dict(parameters_schema(fn))
        for name, schema in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools: the definition {name!r} has two different schemas")
        items.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_required(text: str) -> Parsed:
    """A "required" answer's calls (its grammar made it a list of {"name", "parameters"}; one cut
    short by max_tokens gives none)."""
    try:
        items = json.loads(text)
        return None, [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
    except (ValueError, KeyError, TypeError):
        return None, []


@dataclass(frozen=True)
class ToolPlan:
    """How a request's answers become tool calls: mode "named" (function `name`), "required" or
    "auto"; `parser`: the server's (--tool-call-parser), which "auto" needs."""

    mode: str
    name: str | None = None
    parser: Parser | None = None

    @property
    def enveloped(self) -> bool:
        """Forced calls written in the parser's envelope (else bare JSON)."""
        return self.mode != "auto" and self.parser is not None and bool(self.parser.envelope)

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> tuple[str, dict[str, Any]] | None:
        """(grammar.KINDS kind, source) the answer is decoded under: a forced call's, or "auto"'s
        where a tool is strict and the parser has an envelope (else None: decoded freely)."""
        fns = [t["function"] for t in tools if self.mode != "named" or t["function"]["name"] == self.name]
        envelope = self.parser.envelope if self.parser is not None else ()
        tags = [{"type": "tag", "begin": begin + fn["name"] + ARGUMENTS_AFTER_NAME, "end": end,
                 "content": {"type": "json_schema", "json_schema": parameters_schema(fn)}}
                for fn in fns for begin, end in envelope]
        if self.mode == "auto":
            if not envelope or not any(fn.get("strict") is True for fn in fns):
                return None
            trigger = os.path.commonprefix([begin for begin, _ in envelope])
            return "structural_tag", {"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": [trigger], "tags": tags}}
        if self.enveloped:
            return "structural_tag", {"type": "structural_tag", "format": {
                "type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
                "stop_after_first": self.mode == "named" or not parallel}}
        if self.mode == "named":
            return "json_schema", parameters_schema(fns[0])
        return "json_schema", required_schema(tools, parallel)

    def call_id(self) -> str:
        """A new call's id, in the parser's form (Mistral's templates take 9 characters)."""
        return (self.parser.call_id if self.parser is not None else tool_call_id)()

    def parse(self, text: str) -> Parsed:
        if self.enveloped:
            assert self.parser is not None
            return None, self.parser.parse(text)[1]
        if self.mode == "named":
            return (None, [(self.name, text)]) if text.strip() else (None, [])
        if self.mode == "required":
            return parse_required(text)
        assert self.parser is not None
        return self.parser.parse(text)

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's message fields (content, tool_calls) and finish reason."""
        content, calls = self.parse(text)
        if self.mode == "auto":
            if not calls:
                return {"content": text}, finish
            return ({"content": content, "tool_calls": [call_object(n, a, self.call_id()) for n, a in calls]},
                    "tool_calls")
        fields = {"content": "", "tool_calls": [call_object(n, a, self.call_id()) for n, a in calls]}
        return fields, self.finish_with_calls(finish)

    def finish_with_calls(self, finish: str | None) -> str | None:
        """The finish reason of an answer with calls: "tool_calls" for "auto", and for "required"
        where it ended (vLLM's)."""
        with_calls = self.mode == "auto" or (self.mode == "required" and finish == "stop")
        return "tool_calls" if with_calls else finish

    def stream(self) -> ToolStream:
        return ToolStream(self)


@dataclass
class StreamedCall:
    """A call whose id and name went out and whose arguments (a JSON object in the answer's
    text) stream as vLLM streams them: re-serialised as json.dumps writes them (", ", ": ",
    strings and numbers in its form), so the pieces add up to a whole answer's arguments."""

    read: int  # how far into the text the value's scan has read (from where the value starts)
    end: int | None = None  # where the value ends, once its brackets close
    depth: int = 0
    string: str | None = None  # a string being read, from its opening quote
    string_sent: int = 0  # how many of its characters went out (in json.dumps' form): whole escapes
    token: str = ""  # a number or literal being read

    def feed(self, text: str) -> str:
        """The arguments' next piece from the text read so far."""
        out, i = [], self.read
        while i < len(text) and self.end is None:
            ch, i = text[i], i + 1
            if self.string is not None:
                self.string += ch
                if ch == '"' and (len(self.string) - len(self.string[:-1].rstrip("\\")) - 1) % 2 == 0:
                    out.append(self._string_piece(closed=True))
                    self.string = None
                continue
            if ch.isspace() or ch in '{}[],:"':
                out.append(self._token_piece())
            if ch == '"':
                self.string, self.string_sent = ch, 1
                out.append(ch)
            elif ch in "{[":
                self.depth += 1
                out.append(ch)
            elif ch in "}]":
                self.depth -= 1
                out.append(ch)
                self.end = i if self.depth == 0 else None
            elif ch in ",:":
                out.append(ch + " ")
            elif not ch.isspace():
                self.token += ch
        self.read = i
        if self.string is not None:
            out.append(self._string_piece(closed=False))
        return "".join(out)

    def _token_piece(self) -> str:
        token, self.token = self.token, ""
        try:
            return json.dumps(json.loads(token)) if token else ""
        except ValueError:
            return token

    def _string_piece(self, closed: bool) -> str:
        """The string's text since the last piece, in json.dumps' form: up to its closing quote
        once closed, else up to where its text is whole (not inside an escape or a surrogate
        pair). json.dumps escapes a string a character at a time, so pieces of whole escapes add
        up to the whole string's form, and each piece reads only the new text."""
        assert self.string is not None
        end = len(self.string) - 1 if closed else len(self.string)
        for cut in range(end, max(end - 12, self.string_sent) - 1, -1):
            try:
                value = json.loads(f'"{self.string[self.string_sent:cut]}"')
            except ValueError:
                if closed:  # not JSON after all: the rest as written
                    break
                continue
            if not closed and value and "\ud800" <= value[-1] <= "\udbff":
                continue
            self.string_sent = cut
            return json.dumps(value, ensure_ascii=False)[1:-1] + ('"' if closed else "")
        if closed:
            rest, self.string_sent = self.string[self.string_sent:], len(self.string)
            return rest
        return ""


def merge_deltas(*deltas: dict[str, Any] | None) -> dict[str, Any] | None:
    """Deltas of one chunk as one: the content joined, a call's pieces (by index) in one entry."""
    content, calls = "", {}
    for delta in deltas:
        content += (delta or {}).get("content", "")
        for call in (delta or {}).get("tool_calls", []):
            if call["index"] not in calls:
                calls[call["index"]] = call | {"function": dict(call.get("function", {}))}
                continue
            into = calls[call["index"]]
            into.update({k: v for k, v in call.items() if k != "function"})
            fn = into.setdefault("function", {})
            fn.update({k: v for k, v in call.get("function", {}).items() if k != "arguments"})
            if "arguments" in call.get("function", {}):
                fn["arguments"] = fn.get("arguments", "") + call["function"]["arguments"]
    merged = {"content": content} if content else {}
    return (merged | {"tool_calls": list(calls.values())} if calls else merged) or None


@dataclass
class ToolStream:
    """One streamed choice's deltas under a ToolPlan: feed() the text as it is released, end()
    once it is whole."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # content (auto) or arguments (named) already sent
    call_id: str | None = None
    calls: list[StreamedCall] = field(default_factory=list)  # the calls streamed so far
    scanned: int = 0  # where the next call may start (past the last call's arguments)
    whole: bool = False  # a call not in the streamed form: the rest come whole at the end

    @property
    def streams_calls(self) -> bool:
        parser = self.plan.parser
        return bool(parser and parser.next_call) and (self.plan.mode == "auto" or self.plan.enveloped)

    def feed(self, delta: str) -> dict[str, Any] | None:
        """The delta fields for newly released text, or None while there is nothing to send."""
        self.text += delta
        if self.plan.mode == "named" and not self.plan.enveloped:
            return self._named_arguments()
        out: dict[str, Any] = {}
        if self.plan.mode == "auto":
            assert self.plan.parser is not None
            end = self.plan.parser.content_end(self.text)
            if end > self.sent:
                out["content"], self.sent = self.text[self.sent:end], end
        return merge_deltas(out, self._stream_calls()) if self.streams_calls else (out or None)

    def _stream_calls(self) -> dict[str, Any] | None:
        """The tool-call deltas the text released: a new call's id and name, its arguments' text."""
        assert self.plan.parser is not None
        pieces = []
        while not self.whole:
            if self.calls and self.calls[-1].end is None:  # a call's arguments stream
                call = self.calls[-1]
                piece = call.feed(self.text)
                if piece:
                    pieces.append({"tool_calls": [{"index": len(self.calls) - 1,
                                                   "function": {"arguments": piece}}]})
                if call.end is None:
                    break
                self.scanned = call.end
                continue
            head = self.plan.parser.next_call(self.text, self.scanned)
            if isinstance(head, str):
                self.whole = head == WHOLE
                break
            name, start = head
            self.calls.append(StreamedCall(start))
            pieces.append({"tool_calls": [{"index": len(self.calls) - 1, "id": self.plan.call_id(),
                                           "type": "function", "function": {"name": name, "arguments": ""}}]})
        return merge_deltas(*pieces)

    def _named_arguments(self) -> dict[str, Any] | None:
        piece, self.sent = self.text[self.sent:], len(self.text)
        if self.call_id is None:
            if not piece:
                return None
            self.call_id = self.plan.call_id()
            return {"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                    "function": {"name": self.plan.name, "arguments": piece}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else None

    def end(self, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The last delta (what was held back) and the finish reason, once the answer is whole."""
        if self.plan.mode == "named" and not self.plan.enveloped:
            return self._named_arguments(), finish
        fields, whole_finish = self.plan.message(self.text, finish)
        calls = fields.get("tool_calls") or []
        if self.calls:  # calls went out: the answer is theirs; the ones after them come whole
            rest = [{"index": i} | c for i, c in enumerate(calls) if i >= len(self.calls)]
            cut = self.calls[-1].end is None  # its arguments unfinished (max_tokens): say so
            finish = finish if cut else self.plan.finish_with_calls(finish)
            return ({"tool_calls": rest} if rest else None), finish
        delta: dict[str, Any] = {}
        if self.plan.mode == "auto":
            content = (fields["content"] or "") if calls else self.text
            if len(content) > self.sent:
                delta["content"] = content[self.sent:]
        if calls:
            delta["tool_calls"] = [{"index": i} | c for i, c in enumerate(calls)]
        return delta or None, whole_finish
