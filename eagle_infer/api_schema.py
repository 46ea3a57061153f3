"""OpenAI API shapes: request bodies (strict JSON types; unknown OpenAI fields are accepted and
ignored), the error body, and the logprobs objects of chat and completions answers."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from eagle_infer.tool_calls import Parser, ToolPlan

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs (vLLM's default max_logprobs is 20 too)


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.

    Every invalid request is a 400 `invalid_request_error` (as OpenAI and vLLM answer), 401 a bad
    key, 404 an unknown model or route, 413 a body over the size cap, 503 an engine failure."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_error(message: str) -> ApiError:
    """A failure inside the engine: the request fails, the server keeps serving."""
    return ApiError(503, message, code="engine_error")


# OpenAI's and vLLM's request fields that change the answer and that this server does not
# implement, with the values that change nothing (a client may send those): any other value is
# refused with a 400 naming the field, where answering as if it were absent would mislead.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "use_beam_search": (None, False),
    "tools": (None, []), "functions": (None, []),
    "length_penalty": (None, 1, 1.0),
}


# vLLM's structured_outputs keys: what they ask for (grammar.KINDS), and options that tune its
# own backends' whitespace or fallback (accepted, without effect here)
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json", "structural_tag": "structural_tag"}
STRUCTURED_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "backend"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None  # None: an assistant turn that only called tools
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a "tool" turn: the call it answers
    name: str | None = None

    def for_template(self, parts: bool = False) -> dict[str, Any]:
        """The message as chat templates read it: content a string (its parts' texts on lines of
        their own; with parts, a list of
        {type: text, text} parts: --chat-template-content-format openai), and a call's arguments
        an object where the API sends JSON text (vLLM's and transformers' convention; arguments
        that are not a JSON object become {}, so a bad turn in the history does not fail every
        later request)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ApiError(400, "messages: content is required (an assistant's turn with tool_calls may "
                                "leave it out)", param="messages", code="missing_field")
        texts = [self.content] if isinstance(self.content, str) else [p.text for p in self.content or []]
        # (a string's parts joined by newlines, as vLLM joins them)
        content = [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)
        msg: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                fn = call.get("function")
                if call.get("type", "function") != "function" or not isinstance(fn, dict) or "name" not in fn:
                    raise ApiError(400, "an assistant's tool_calls entry must be {\"type\": \"function\", "
                                        "\"function\": {\"name\", \"arguments\"}}", param="messages",
                                   code="invalid_value")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        args = {}
                calls.append(call | {"function": fn | {"arguments": args if isinstance(args, dict) else {}}})
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


class ToolFunction(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"]
    function: ToolFunction


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class StreamOptions(_Body):
    include_usage: bool = False


class Generation(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (SGLang / vLLM); -1 or 0 = off
    min_p: float = 0.0  # extension (SGLang / vLLM); 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (SGLang / vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    min_tokens: int = 0  # extension (vLLM): EOS and stop_token_ids barred before then
    stop_token_ids: list[int] | None = None  # extension (vLLM / SGLang): tokens that end the answer
    allowed_token_ids: list[int] | None = None  # extension (vLLM): the only tokens the answer may use
    bad_words: list[str] | None = None  # extension (vLLM): words the answer may not contain
    # structured outputs: OpenAI's response_format ({"type": "text" | "json_object" | "json_schema",
    # "json_schema": {"schema": ...}}), vLLM's structured_outputs ({"json" | "regex" | "choice" |
    # "grammar": ...}) and its older guided_* fields; one of them at a time (structured())
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = False  # extension (SGLang / vLLM), for benchmarks
    skip_special_tokens: bool = True  # extension (vLLM): False keeps special tokens' text
    include_stop_str_in_output: bool = False  # extension (vLLM): a matched stop string stays in the text
    # extension (vLLM): logprobs tokens as "token_id:{id}" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None  # extension (vLLM): each prompt token's log-prob and k alternatives

    def unsupported_field(self) -> str | None:
        """The first field this server would otherwise ignore although it changes the answer
        (UNSUPPORTED: set to other than its no-op values); unknown fields stay ignored, as
        vLLM's."""
        extra = self.model_extra or {}
        return next((k for k, noop in UNSUPPORTED.items() if k in extra and extra[k] not in noop), None)

    def top_logprobs_asked(self) -> int | None:
        """None: no logprobs; k: the emitted token's log-prob and k alternatives."""
        raise NotImplementedError

    def structured(self) -> tuple[str, str, Any] | None:
        """The structured output asked for, as (field, kind, source) with kind one of
        grammar.KINDS, or None (response_format text is none)."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            schema = (rf.get("json_schema") or {}).get("schema") if rf.get("type") == "json_schema" else None
            if rf.get("type") == "json_object":
                asked.append(("response_format", "json", None))
            elif isinstance(schema, dict):
                asked.append(("response_format", "json_schema", schema))
            else:
                raise ApiError(400, "response_format: type text, json_object, or json_schema with "
                                    "json_schema.schema an object", param="response_format",
                               code="invalid_value")
        so = {k: v for k, v in (self.structured_outputs or {}).items() if v is not None}
        for key, value in so.items():
            if key in STRUCTURED_OPTIONS:
                continue
            kind = STRUCTURED_KINDS.get(key)
            if kind is None:
                raise ApiError(400, f"structured_outputs.{key} is not supported (one of "
                                    f"{', '.join(STRUCTURED_KINDS)})", param="structured_outputs",
                               code="unsupported_parameter")
            if key != "json_object" or value:
                asked.append(("structured_outputs", kind, value))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, kind, getattr(self, name)))
        if len(asked) > 1:
            raise ApiError(400, f"one structured output at a time, got {', '.join(a[0] for a in asked)}",
                           param=asked[1][0], code="invalid_value")
        return asked[0] if asked else None


class ChatRequest(Generation):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # the chat template's inputs (vLLM's extensions): extra variables (e.g. enable_thinking),
    # and whether the prompt opens the assistant's turn or continues the last message
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's: this request's template (--trust-request-chat-template)
    # vLLM's: at most that many tokens of reasoning (--reasoning-parser), then its end is forced
    thinking_token_budget: int | None = None

    def tool_plan(self, parser: Parser | None, auto: bool) -> ToolPlan | None:
        """How the answer becomes tool calls (tool_calls.ToolPlan), None for a plain answer.
        parser: the server's --tool-call-parser; auto: --enable-auto-tool-choice, without which
        (or a parser) "auto" is refused, as vLLM refuses it. tools without tool_choice mean
        "auto" (OpenAI's)."""
        if self.tools is not None and not self.tools:
            raise ApiError(400, "tools must not be an empty array (leave it out)", param="tools",
                           code="invalid_value")
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice == "none":
            return None
        if not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if choice.function.name not in names:
                raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not one of the "
                                    f"tools ({', '.join(names)})", param="tool_choice", code="invalid_value")
            plan = ToolPlan("named", name=choice.function.name, parser=parser)
        elif choice == "required":
            plan = ToolPlan("required", parser=parser)
        else:
            if parser is None or not auto:
                raise ApiError(400, 'tool_choice "auto" needs the server started with '
                                    "--enable-auto-tool-choice and --tool-call-parser (a named function "
                                    'or "required" work without)',
                               param="tool_choice", code="invalid_value")
            plan = ToolPlan("auto", parser=parser)
        asked = self.structured() if plan.mode != "auto" else None
        if asked is not None:
            raise ApiError(400, f"a forced tool call is a structured output already: leave out "
                                f"{asked[0]} or set tool_choice to auto or none",
                           param=asked[0], code="invalid_value")
        return plan

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs",
                           code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Generation):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt or a batch
    logprobs: int | None = None  # the legacy API: an int, the number of alternatives
    echo: bool = False  # the prompt's text (and with logprobs its tokens') ahead of the answer

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt's tokens, or chat messages' through the chat template (as a chat
    request would prompt the model)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt's (BOS); messages get the template's
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool = False

    tool_dicts = ChatRequest.tool_dicts


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids to text."""

    model: str | None = None
    tokens: list[int]


def check_logprobs(k: int | None, param: str, most: int = MAX_LOGPROBS) -> None:
    """k alternatives asked for each token: at most `most` (the server's --max-logprobs)."""
    if k is not None and not 0 <= k <= most:
        raise ApiError(400, f"{param} must be in [0, {most}], got {k}", param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------
# logprobs in the answer. `entries`: per token (token id, text, log-prob, [(id, text, log-prob)])


LogprobEntry = tuple[int, str, float | None, list[tuple[int, str, float]] | None]  # None: echo's first


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]} (chat completions)."""

    def one(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [one(text, lp) | {"top_logprobs": [one(t, v) for _, t, v in top]}
                        for _, text, lp, top in entries], "refusal": None}


def completion_logprobs(entries: list[LogprobEntry], offsets: list[int]) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs": [{text: lp}], "text_offset"} (legacy completions)."""
    return {"tokens": [text for _, text, _, _ in entries],
            "token_logprobs": [lp for _, _, lp, _ in entries],
            "top_logprobs": [None if top is None else {t: v for _, t, v in top} for _, _, _, top in entries],
            "text_offset": offsets}
