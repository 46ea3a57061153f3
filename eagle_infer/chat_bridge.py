"""The chat path under the other APIs (responses_api: OpenAI's Responses, anthropic_api:
Anthropic's Messages): the chat request a request stands for, validated, and a streamed chat
answer's chunks read back as the pieces those APIs' events are made of."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Collection
from typing import Any

from pydantic import ValidationError

from eagle_infer.api_schema import ApiError, ChatRequest, Generation

# chat request fields another API's request may carry as extensions (vLLM's Responses and
# Messages requests take its sampling extensions too), where that API has no name of its own
CHAT_EXTENSIONS = frozenset(Generation.model_fields) - {
    "model", "max_tokens", "temperature", "top_p", "stream", "stream_options", "n", "response_format",
    "prompt_logprobs", "return_tokens_as_token_ids"} | {"chat_template_kwargs"}


def chat_request_of(body: dict[str, Any], extra: dict[str, Any] | None, named: Collection[str],
                    param: str) -> ChatRequest:
    """The chat request of `body` (the chat fields a request sets) and of the request's chat
    extensions (`extra`: its fields unknown to its API) but those it names itself (`named`);
    a chat field that does not validate is a 400 naming `param`."""
    passed = {k: v for k, v in (extra or {}).items() if k in CHAT_EXTENSIONS and k not in named}
    try:
        return ChatRequest.model_validate(passed | body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"{param} (as chat {where}): {first['msg']}", param=param,
                       code="invalid_value") from None


async def chat_pieces(chunks: AsyncGenerator[str]) -> AsyncGenerator[tuple[str, Any]]:
    """A streamed one-choice chat answer's chunks (server.sse_stream's JSON texts, its usage
    chunk last, then [DONE]) as pieces, in order: ("reasoning", text), ("content", (text,
    logprobs); the text empty where a token without text has log-probs), ("call", (index, id,
    name)) when a tool call starts, ("arguments", (index, text)), ("finish", (finish_reason,
    stop_reason)), ("usage", usage), or ("error", error) to end an answer that failed. The chat
    stream is closed when this generator ends or is closed (a client gone: that cancels the
    answer's jobs); close this one with contextlib.aclosing."""
    calls: set[int] = set()
    try:
        async for raw in chunks:
            if raw == "[DONE]":
                return
            chunk = json.loads(raw)
            if "error" in chunk:
                yield "error", chunk["error"]
                return
            if chunk.get("usage"):
                yield "usage", chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning"):
                    yield "reasoning", delta["reasoning"]
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                if delta.get("content") or logprobs:  # (a token without text may carry log-probs)
                    yield "content", (delta.get("content") or "", logprobs)
                for piece in delta.get("tool_calls") or []:
                    fn = piece.get("function") or {}
                    if piece["index"] not in calls:  # a call's first piece has its id and name
                        calls.add(piece["index"])
                        yield "call", (piece["index"], piece["id"], fn["name"])
                    if fn.get("arguments"):
                        yield "arguments", (piece["index"], fn["arguments"])
                if choice.get("finish_reason") is not None:
                    yield "finish", (choice["finish_reason"], choice.get("stop_reason"))
    finally:
        await chunks.aclose()
