"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`, as vLLM serves
them, so that Anthropic's SDK and the tools built on it reach this server) over the chat path: a
request becomes a chat request (its content blocks the chat turns: text, tool_use calls,
tool_result turns), the chat answer a message (thinking / text / tool_use blocks), or its stream
of chunks Anthropic's stream of events. Errors take Anthropic's shape."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from eagle_infer.api_schema import ApiError, ChatRequest, _Body
from eagle_infer.chat_bridge import chat_pieces, chat_request_of

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # else end_turn or stop_sequence
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def error_body(err: ApiError) -> dict[str, Any]:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class MessagesRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # accepted: the --reasoning-parser splits the text
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}}
    metadata: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The chat turns: the system prompt first, then each message's blocks (a user's
        tool_result blocks each a tool turn, an assistant's tool_use blocks its calls)."""
        msgs: list[dict[str, Any]] = []
        system = self.system
        if isinstance(system, list):  # Claude Code's billing header block: client metadata (vLLM drops it)
            system = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(
                "x-anthropic-billing-header"))]
        if system:
            msgs.append({"role": "system", "content": block_text(system, "system")})
        for i, message in enumerate(self.messages):
            where, role, content = f"messages[{i}]", message.get("role"), message.get("content")
            if role not in ("user", "assistant", "system") or content is None:
                raise ApiError(400, f"{where}: role user or assistant, and content", param="messages",
                               code="invalid_value")
            if isinstance(content, str):
                msgs.append({"role": role, "content": content})
                continue
            if not isinstance(content, list):
                raise ApiError(400, f"{where}: content must be a string or a list of blocks",
                               param="messages", code="invalid_value")
            texts, calls = [], []
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                elif kind == "tool_use" and role == "assistant":
                    calls.append({"id": block.get("id"), "type": "function", "function": {
                        "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
                elif kind == "tool_result" and role == "user":
                    # the tool turns first, the user's text after them (vLLM's order: a template
                    # wants the results right after the calls)
                    result = block.get("content") or ""
                    text = result if isinstance(result, str) else block_text(result, where)
                    msgs.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": ("Error: " + text) if block.get("is_error") else text})
                elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                    continue  # earlier reasoning: chat templates drop it from the history too
                else:
                    raise ApiError(400, f"{where}: content blocks of type {kind!r} are not supported here "
                                        "(text; tool_use in assistant turns, tool_result in user turns)",
                                   param="messages", code="unsupported_parameter")
            if texts or calls or not any(b.get("type") == "tool_result" for b in content):
                text = "\n".join(texts) if texts or not calls else None  # blocks on lines of their own
                turn: dict[str, Any] = {"role": role, "content": text}
                if calls:
                    turn["tool_calls"] = calls
                msgs.append(turn)
        return msgs

    def chat_request(self) -> ChatRequest:
        """The chat request this request stands for."""
        body: dict[str, Any] = {"messages": self.conversation(), "max_tokens": self.max_tokens}
        if (self.thinking or {}).get("type") == "disabled":  # Qwen3's templates' switch (vLLM maps it too)
            given = (self.model_extra or {}).get("chat_template_kwargs") or {}
            body["chat_template_kwargs"] = {"enable_thinking": False} | given
        elif (self.thinking or {}).get("budget_tokens") is not None:  # enabled: a cap on the reasoning
            body["thinking_token_budget"] = self.thinking["budget_tokens"]
        for ours, chat in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                           ("stop_sequences", "stop")):
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        choice = self.tool_choice
        if choice is not None and self.tools:
            kind = choice.get("type")
            if kind == "tool":
                if not isinstance(choice.get("name"), str):
                    raise ApiError(400, "tool_choice: type tool needs a name", param="tool_choice",
                                   code="invalid_value")
                body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
            elif kind in ("auto", "any", "none"):
                body["tool_choice"] = {"any": "required"}.get(kind, kind)
            else:
                raise ApiError(400, "tool_choice: type auto, any, tool or none", param="tool_choice",
                               code="invalid_value")
            if choice.get("disable_parallel_tool_use"):
                body["parallel_tool_calls"] = False
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise ApiError(400, "output_config.format: type json_schema with a schema object",
                               param="output_config", code="invalid_value")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": fmt["schema"]}}
        if self.stream:
            body["stream"], body["stream_options"] = True, {"include_usage": True}
        return chat_request_of(body, self.model_extra, ("top_k", "stop"), "messages")


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int = 1


def block_text(blocks: Any, where: str) -> str:
    """The text of a system prompt or a tool result given as blocks (text blocks only)."""
    if isinstance(blocks, str):
        return blocks
    texts = [b.get("text") for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
    if len(texts) != len(blocks) or not all(isinstance(t, str) for t in texts):
        raise ApiError(400, f"{where}: only text blocks are supported here", param="messages",
                       code="unsupported_parameter")
    return "\n".join(texts)  # (blocks on lines of their own, as vLLM joins them)


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """An Anthropic tool ({name, description, input_schema}) as a chat tool; server tools (web
    search, code execution: a `type` other than custom) are not for this server."""
    if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
        raise ApiError(400, f"tools[{i}]: only custom tools ({{\"name\", \"input_schema\"}}) are supported "
                            f"here, got type {tool.get('type')!r}", param="tools",
                       code="unsupported_parameter")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


def stop_of(finish: str | None, stop_reason: Any, called: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat answer's finish_reason and stop_reason (the stop
    string it matched, a stop token's id, or None at EOS); an answer with calls ends in tool_use
    unless cut (a named tool's chat answer finishes with stop, as OpenAI's)."""
    if called and finish != "length":
        return "tool_use", None
    if finish == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish or "", "end_turn"), None


class MessageShape:
    """One request's message: from the chat answer, or its events from the chat chunks."""

    def __init__(self, model: str, prompt_tokens: int):
        self.model, self.prompt_tokens = model, prompt_tokens
        self.id = f"msg_{uuid.uuid4().hex}"

    @staticmethod
    def error_body(err: ApiError) -> dict[str, Any]:
        return error_body(err)

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content,
                "model": self.model, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def usage(self, chat_usage: dict[str, Any] | None, output_tokens: int = 0) -> dict[str, Any]:
        cached = ((chat_usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": self.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
                "output_tokens": (chat_usage or {}).get("completion_tokens", output_tokens)}

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The message of a chat answer (server.full_response's)."""
        choice = answer["choices"][0]
        message, content = choice["message"], []
        if message.get("reasoning"):
            content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        content += [tool_use_block(call) for call in calls]
        if not content:  # an empty answer: one empty text block, as vLLM (clients read content[0])
            content.append({"type": "text", "text": ""})
        stop = stop_of(choice["finish_reason"], choice.get("stop_reason"), called=bool(calls))
        return self.message(content, stop, self.usage(answer["usage"]))

    async def events(self, chunks: AsyncGenerator[str]) -> AsyncGenerator[dict[str, str]]:
        """Anthropic's events (SSE `event` and `data`) of a streamed chat answer's chunks
        (server.sse_stream's JSON texts, its usage chunk last, then [DONE])."""
        def event(kind: str, **fields: Any) -> dict[str, str]:
            return {"event": kind, "data": json.dumps({"type": kind} | fields)}

        index = -1  # the open block's
        open_kind: str | None = None
        calls: set[int] = set()  # the answer's tool calls, by their chat index
        stop: tuple[str, str | None] = ("end_turn", None)
        usage = None

        def switch_to(kind: str, block: dict[str, Any]) -> list[dict[str, str]]:
            nonlocal index, open_kind
            out = [event("content_block_stop", index=index)] if open_kind is not None else []
            index, open_kind = index + 1, kind
            return out + [event("content_block_start", index=index, content_block=block)]

        # (a client gone mid-stream closes the pieces, which close the chat stream, which cancels
        # the jobs; gone before the chat stream started, server.run's background task cancels them)
        async with contextlib.aclosing(chat_pieces(chunks)) as pieces:
            yield event("message_start", message=self.message([], (None, None), self.usage(None)))
            async for kind, value in pieces:
                if kind == "error":
                    yield event("error", error={"type": "api_error", "message": value.get("message")})
                    return
                if kind == "usage":
                    usage = value
                elif kind == "finish":
                    stop = stop_of(*value, called=bool(calls))
                elif kind in ("reasoning", "content"):
                    block_kind, text = ("thinking", value) if kind == "reasoning" else ("text", value[0])
                    if not text:
                        continue  # a token without text (its log-probs are not Anthropic's)
                    if open_kind != block_kind:
                        block = {"type": block_kind, block_kind: ""}
                        if block_kind == "thinking":
                            block["signature"] = ""
                        for ev in switch_to(block_kind, block):
                            yield ev
                    yield event("content_block_delta", index=index,
                                delta={"type": f"{block_kind}_delta", block_kind: text})
                elif kind == "call":
                    calls.add(value[0])
                    for ev in switch_to("tool_use", {"type": "tool_use", "id": value[1], "name": value[2],
                                                     "input": {}}):
                        yield ev
                elif kind == "arguments":
                    yield event("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": value[1]})
        if open_kind is not None:
            yield event("content_block_stop", index=index)
        yield event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                    usage=self.usage(usage))
        yield event("message_stop")
