"""OpenAI API shapes: request bodies (strict JSON types; unknown OpenAI fields are accepted and
ignored), the error body, and the logprobs objects of chat and completions answers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

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
    "prompt_logprobs": (None,), "tools": (None, []), "functions": (None, []),
    "length_penalty": (None, 1, 1.0),
}


# vLLM's structured_outputs keys: what they ask for (grammar.KINDS), and options that tune its
# own backends' whitespace or fallback (accepted, without effect here)
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json"}
STRUCTURED_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "backend"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart]


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
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs tokens as "token_id:{id}"

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


def check_logprobs(k: int | None, param: str) -> None:
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {k}", param=param,
                       code="invalid_value")


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
