"""OpenAI's Responses API (`POST /v1/responses`, as vLLM and SGLang serve it) over the chat path:
a request becomes a chat request (its input items the messages, its function tools the chat
tools, `text.format` the response_format), and the chat answer becomes a response object, or its
stream of chunks a stream of Responses events. Responses are kept in memory (the last
STORED_RESPONSES with `store`, the default) for `previous_response_id` and
`GET /v1/responses/{id}`; a background response that streams keeps its events (EventLog, the last
STREAMED_LOGS) for a client that lost the stream to read again after a sequence number
(`GET /v1/responses/{id}?stream=true&starting_after=N`, OpenAI's and vLLM's)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from eagle_infer.api_schema import ApiError, ChatRequest, _Body
from eagle_infer.chat_bridge import chat_pieces, chat_request_of

STORED_RESPONSES = 1000  # in memory, lost at a restart (vLLM's store is in memory too)
STREAMED_LOGS = 100  # background streams' events kept (~300 bytes an event: a token's delta)


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system turn first (not carried to a next response)
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None  # "message.output_text.logprobs": the answer's log-probs
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema"}}
    reasoning: dict[str, Any] | None = None  # accepted: the --reasoning-parser splits the text
    stream: bool = False
    store: bool = True
    background: bool = False
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    def conversation(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages of history (a previous response's) and this request's input items,
        instructions left out."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        msgs = list(history)
        for i, item in enumerate(items):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            if kind == "message":
                if not isinstance(item.get("role"), str) or "content" not in item:
                    raise ApiError(400, f"{where}: a message needs role and content", param="input",
                                   code="invalid_value")
                msgs.append({"role": item["role"], "content": text_of(item["content"], where)})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
                fields = (call["id"], item.get("name"), item.get("arguments", ""))
                if not all(isinstance(v, str) for v in fields):
                    raise ApiError(400, f"{where}: a function_call needs call_id, name and arguments "
                                        "(strings)", param="input", code="invalid_value")
                last = msgs[-1] if msgs else None
                if last is not None and last["role"] == "assistant":
                    # one turn's calls in one message; a new dict: the history's are a stored response's
                    msgs[-1] = last | {"tool_calls": [*(last.get("tool_calls") or []), call]}
                else:
                    msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if not isinstance(item.get("call_id"), str) or "output" not in item:
                    raise ApiError(400, f"{where}: a function_call_output needs call_id and output",
                                   param="input", code="invalid_value")
                msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": text_of(item["output"], where)})
            elif kind == "reasoning":
                continue  # earlier reasoning: chat templates drop it from the history too
            else:
                raise ApiError(400, f"{where}: input items of type {kind!r} are not supported here (message, "
                                    "function_call, function_call_output, reasoning)", param="input",
                               code="unsupported_parameter")
        return msgs

    def chat_request(self, conversation: list[dict[str, Any]]) -> ChatRequest:
        """The chat request this request stands for (instructions as a first system turn)."""
        if self.background and not self.store:
            raise ApiError(400, "a background response must be stored (store: true) to be retrieved",
                           param="background", code="invalid_value")
        if self.truncation not in (None, "disabled"):
            raise ApiError(400, "truncation: only 'disabled' (a prompt over the context is refused)",
                           param="truncation", code="unsupported_parameter")
        body: dict[str, Any] = {}
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body["messages"] = system + conversation
        for ours, chat in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                           ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
            if getattr(self, ours) is not None:
                body[chat] = getattr(self, ours)
        if self.tools:  # an empty list is no tools (OpenAI's Responses API takes it; clients send it)
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None and (self.tools or self.tool_choice not in ("auto", "none")):
            choice = self.tool_choice  # (auto or none without tools: no choice to make, as vLLM takes it)
            if isinstance(choice, dict):
                if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                    raise ApiError(400, 'tool_choice: "none", "auto", "required" or {"type": "function", '
                                        '"name": ...}', param="tool_choice", code="invalid_value")
                choice = {"type": "function", "function": {"name": choice["name"]}}
            body["tool_choice"] = choice
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        elif fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.get("type") != "text":
            raise ApiError(400, "text.format: type text, json_object or json_schema", param="text.format",
                           code="invalid_value")
        if self.stream:
            body["stream"], body["stream_options"] = True, {"include_usage": True}
        if self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or []):
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        return chat_request_of(body, self.model_extra, (), "input")


def text_of(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content as chat messages carry it: a string, or text parts (input_text, and
    output_text of earlier answers); images, files and audio are not for this text-only server."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be a string or a list of parts", param="input",
                       code="invalid_value")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ApiError(400, f"{where}: content parts of type {kind!r} are not supported here (text only: "
                                "input_text, output_text)", param="input", code="unsupported_parameter")
    return parts


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) as a chat tool."""
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise ApiError(400, f"tools[{i}]: only function tools ({{\"type\": \"function\", \"name\", "
                            f"\"parameters\"}}) are supported here, got type {tool.get('type')!r}",
                       param="tools", code="unsupported_parameter")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, logprobs: list[dict[str, Any]],
                 status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": logprobs}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def usage_of(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    thought = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # its chat messages, the answer's included (no instructions)
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's, as listed


ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def new_item_id(item_type: str) -> str:
    """A new id for an item of this type, with OpenAI's prefix for it."""
    return new_id(ITEM_ID_PREFIX.get(item_type, "item"))


def input_items_of(req: ResponsesRequest) -> list[dict[str, Any]]:
    """A request's input as OpenAI lists it (GET /v1/responses/{id}/input_items): each item with an
    id, a message's text content as one input_text part (output_text for the assistant's)."""
    given = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    items = []
    for item in given:
        item = {"type": "message", **item}
        if item["type"] == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", new_item_id(item["type"]))
        items.append(item)
    return items


def page_of(items: list[dict[str, Any]], limit: int, order: str, after: str | None,
            before: str | None) -> dict[str, Any]:
    """OpenAI's list page of items: `order` asc (input order) or desc (the default, newest first),
    the items after / before the one with that id, at most `limit` (1-100)."""
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be in [1, 100], got {limit}", param="limit", code="invalid_value")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order!r}", param="order", code="invalid_value")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"{name}: no item {cursor!r} in this response's input", param=name,
                           code="invalid_value")
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(ordered)
    window = ordered[start:end]
    data = window[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(window) > limit}


class EventLog:
    """A background stream's events (SSE `event` and `data`, each's sequence number its place),
    kept while its answer runs and after: whoever follows it (the creating request's stream, or a
    client that lost that and asks again) reads those after a sequence number, then the rest as
    they come, until the log is closed."""

    def __init__(self) -> None:
        self.events: list[dict[str, str]] = []
        self.closed = False
        self._grown = asyncio.Event()  # set (and replaced) at each append and at close

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()

    def append(self, event: dict[str, str]) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    async def follow(self, starting_after: int = -1) -> AsyncGenerator[dict[str, str]]:
        at = max(starting_after + 1, 0)
        while True:
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.closed:
                return
            await self._grown.wait()


class ResponseStore:
    """The last STORED_RESPONSES responses of this server, by id, and the last STREAMED_LOGS
    background streams' events."""

    def __init__(self, size: int = STORED_RESPONSES, logs: int = STREAMED_LOGS):
        self.size, self.items = size, collections.OrderedDict[str, Stored]()
        self.log_size, self.logs = logs, collections.OrderedDict[str, EventLog]()

    def put_log(self, response_id: str, log: EventLog) -> None:
        self.logs[response_id] = log
        while len(self.logs) > self.log_size:
            self.logs.popitem(last=False)

    def log_of(self, response_id: str) -> EventLog:
        """The events of a background response that streamed (a 404 for no response, a 400 for
        one that did not stream in the background, or whose events this server no longer keeps)."""
        self.get(response_id, "response_id")
        if response_id not in self.logs:
            raise ApiError(400, f"response {response_id!r} has no events to stream: only a response created "
                                f"with background and stream has (the last {self.log_size} kept); retrieve "
                                "it without stream", param="stream", code="invalid_value")
        return self.logs[response_id]

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id)  # a 404 when there is none
        del self.items[response_id]
        self.logs.pop(response_id, None)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        if response_id not in self.items:
            raise ApiError(404, f"no stored response {response_id!r} (responses are kept in this server's "
                                f"memory, the last {self.size} with store)", param=param, code="not_found")
        return self.items[response_id]

    def conversation_of(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation a response ends, to go on from (previous_response_id): a background
        response's once it has its answer."""
        stored = self.get(response_id, "previous_response_id")
        status = stored.response["status"]
        if status not in ("completed", "incomplete"):
            raise ApiError(400, f"previous response {response_id!r} is {status}: no answer to go on from",
                           param="previous_response_id", code="invalid_value")
        return stored.conversation


def stream_event(kind: str, sequence_number: int, **fields: Any) -> dict[str, str]:
    """One event of a response's stream (SSE `event` and `data`): its type, its place, its fields
    (the `error` event that ends a stream: code, message, param)."""
    return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": sequence_number} | fields)}


class ResponseShape:
    """One request's response: its object from the chat answer, or its events from the chat
    chunks; stored with its conversation when the request asks."""

    def __init__(self, req: ResponsesRequest, chat: ChatRequest, conversation: list[dict[str, Any]],
                 model: str, store: ResponseStore):
        self.req, self.chat, self.conversation, self.model, self.store = req, chat, conversation, model, store
        self.id, self.created = new_id("resp"), int(time.time())
        # its input items, ids given once: a background response is stored at each of its states,
        # and a client paging its items (after / before an id) must see the same ids in each
        self.input_items = input_items_of(req)

    @staticmethod
    def error_body(err: ApiError) -> dict[str, Any]:  # OpenAI's shape, as every other route's
        return err.body()

    def response(self, output: list[dict[str, Any]], finish: str | None, usage: dict[str, Any] | None,
                 status: str | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        """The response object; status from finish ("length": incomplete) unless given (a
        background response's "queued", "in_progress", "cancelled", or "failed" with its error)."""
        if status is None:
            status = "incomplete" if finish == "length" else "completed"
        req, chat = self.req, self.chat
        fmt = (req.text or {}).get("format") or {"type": "text"}
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": req.background, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": self.model, "output": output,
                "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": req.reasoning,
                "store": req.store, "temperature": chat.temperature, "text": {"format": fmt},
                "tool_choice": choice, "tools": req.tools or [], "top_p": chat.top_p,
                "top_logprobs": req.top_logprobs, "truncation": req.truncation or "disabled",
                "usage": None if usage is None else usage_of(usage), "user": req.user,
                "metadata": req.metadata or {}}

    def finished(self, output: list[dict[str, Any]], finish: str | None,
                 usage: dict[str, Any] | None) -> dict[str, Any]:
        """The final response, stored (with the conversation it ends) when asked."""
        answer = self.response(output, finish, usage)
        if self.req.store:
            text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
            calls = [{"id": item["call_id"], "type": "function",
                      "function": {"name": item["name"], "arguments": item["arguments"]}}
                     for item in output if item["type"] == "function_call"]
            turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                turn["tool_calls"] = calls
            self.store.put(Stored(answer, [*self.conversation, turn], self.input_items))
        return answer

    def pending(self, status: str, error: dict[str, str] | None = None) -> dict[str, Any]:
        """A background response without its answer (queued, in progress, cancelled or failed),
        stored as it stands: retrievable, its input items listed, not yet a conversation to go on
        from (previous_response_id refuses it)."""
        response = self.response([], None, None, status, error)
        self.store.put(Stored(response, [], self.input_items))
        return response

    def whole(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The response of a chat answer (server.full_response's)."""
        choice = answer["choices"][0]
        message, output = choice["message"], []
        if message.get("reasoning"):
            output.append(reasoning_item(new_item_id("reasoning"), message["reasoning"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            output.append(message_item(new_item_id("message"), message.get("content") or "", logprobs))
        output += [call_item(new_item_id("function_call"), call) for call in calls]
        if calls and choice["finish_reason"] == "length":  # the last call cut by max_output_tokens
            output[-1]["status"] = "incomplete"
        return self.finished(output, choice["finish_reason"], answer["usage"])

    async def events(self, chunks: AsyncGenerator[str]) -> AsyncGenerator[dict[str, str]]:
        """The Responses events (SSE `event` and `data`) of a streamed chat answer's chunks
        (server.sse_stream's JSON texts, its usage chunk last, then [DONE])."""
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> dict[str, str]:
            return stream_event(kind, next(seq), **fields)

        output: list[dict[str, Any]] = []
        current: dict[str, Any] | None = None  # the item being streamed: its kind, id and text so far
        calls: dict[int, dict[str, Any]] = {}  # the answer's tool calls by their chat index
        finish, usage = None, None

        def close(status: str = "completed") -> list[dict[str, str]]:
            nonlocal current
            if current is None:
                return []
            at, item_id, kind = len(output), current["id"], current["kind"]
            where = {"item_id": item_id, "output_index": at, "content_index": 0}
            done: list[dict[str, str]] = []
            if kind == "reasoning":
                item = reasoning_item(item_id, current["text"])
                done += [event("response.reasoning_text.done", **where, text=current["text"]),
                         event("response.content_part.done", **where, part=item["content"][0])]
            elif kind == "message":
                item = message_item(item_id, current["text"], current["logprobs"])
                done += [event("response.output_text.done", **where, text=current["text"],
                               logprobs=current["logprobs"]),
                         event("response.content_part.done", **where, part=item["content"][0])]
            else:
                item = call_item(item_id, current["call"], status)
                done.append(event("response.function_call_arguments.done", item_id=item_id, output_index=at,
                                  name=item["name"], arguments=item["arguments"]))
            done.append(event("response.output_item.done", output_index=at, item=item))
            output.append(item)
            current = None
            return done

        def open_item(kind: str, call: dict[str, Any] | None = None) -> list[dict[str, str]]:
            nonlocal current
            opened = close()
            at, opened_id = len(output), new_item_id("function_call" if kind == "call" else kind)
            current = {"kind": kind, "id": opened_id, "text": "", "logprobs": [], "call": call}
            if kind == "call":
                assert call is not None
                opened.append(event("response.output_item.added", output_index=at,
                                    item=call_item(opened_id, call, "in_progress")))
                return opened
            if kind == "reasoning":
                item = reasoning_item(opened_id, "", "in_progress")
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = message_item(opened_id, None, [], "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            opened += [event("response.output_item.added", output_index=at, item=item),
                       event("response.content_part.added", item_id=opened_id, output_index=at,
                             content_index=0, part=part)]
            return opened

        def at_current() -> dict[str, Any]:  # where a delta of the open item goes
            assert current is not None
            return {"item_id": current["id"], "output_index": len(output), "content_index": 0}

        def switch_to(kind: str) -> list[dict[str, str]]:  # an item of this kind open, else opened
            return [] if current is not None and current["kind"] == kind else open_item(kind)

        # (a client gone mid-stream closes the pieces, which close the chat stream, which cancels
        # the jobs; gone before the chat stream started, server.run's background task cancels them)
        async with contextlib.aclosing(chat_pieces(chunks)) as pieces:
            yield event("response.created", response=self.response([], None, None, "in_progress"))
            yield event("response.in_progress", response=self.response([], None, None, "in_progress"))
            async for kind, value in pieces:
                if kind == "error":
                    yield event("error", code=value.get("code"), message=value.get("message"),
                                param=value.get("param"))
                    return
                if kind == "usage":
                    usage = value
                elif kind == "finish":
                    finish = value[0]
                elif kind == "reasoning":
                    for ev in switch_to("reasoning"):
                        yield ev
                    assert current is not None
                    current["text"] += value
                    yield event("response.reasoning_text.delta", **at_current(), delta=value)
                elif kind == "content":
                    text, logprobs = value
                    if not text and (current is None or current["kind"] != "message"):
                        continue  # log-probs of tokens without text (EOS) and no message to hold them
                    for ev in switch_to("message"):
                        yield ev
                    assert current is not None
                    current["text"] += text
                    current["logprobs"] += logprobs
                    yield event("response.output_text.delta", **at_current(), delta=text, logprobs=logprobs)
                elif kind == "call":
                    index, call_id, name = value
                    calls[index] = {"id": call_id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}
                    for ev in open_item("call", calls[index]):
                        yield ev
                elif kind == "arguments":
                    index, text = value
                    assert current is not None
                    calls[index]["function"]["arguments"] += text
                    yield event("response.function_call_arguments.delta", item_id=current["id"],
                                output_index=len(output), delta=text)
        if current is None and not output:  # an empty answer is an empty message (as whole)
            for ev in open_item("message"):
                yield ev
        for ev in close("incomplete" if finish == "length" else "completed"):  # a cut call: incomplete
            yield ev
        # vLLM's (and the openai client's stream helper's) last event, whatever the status
        yield event("response.completed", response=self.finished(output, finish, usage))
