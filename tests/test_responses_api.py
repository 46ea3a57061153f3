"""OpenAI's Responses API (/v1/responses) through the `openai` client, on an in-process server
whose answers are scripted (the real tokenizer, chat template, tool and reasoning parsers)."""

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server import scripted_app

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ANSWER = ('<think>Look it up.</think>Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris"}}\n</tool_call>')


def with_client(tokenizer, answer: str, body, reasoning: str | None = "deepseek_r1") -> tuple:
    """body(client) run against an in-process server answering `answer` (`reasoning` the
    reasoning parser, hermes tool calls, our SmolLM2 template with tools): (its result, the
    prompts the engine was given, decoded)."""
    from eagle_infer.server import ServerConfig

    template = (Path(__file__).parents[1] / "conf/chat_templates/smollm2_tools.jinja").read_text()
    engine, app = scripted_app(tokenizer, answer, ServerConfig(
        ["fake"], None, 2048, len(tokenizer), tool_parser="hermes", auto_tools=True,
        reasoning_parser=reasoning, chat_template=template))
    return run_with_client(engine, app, body), [tokenizer.decode(seq.prompt) for seq in engine.dec.added]


def run_with_client(engine, app, body):
    """body(client) with an openai client of the in-process app, its engine started for it."""
    async def go():
        engine.start()
        try:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http,
                                        max_retries=0)
            return await body(client)
        finally:
            engine.stop()

    return asyncio.run(go())


def test_a_response_holds_reasoning_text_and_calls_whole_and_streamed(tokenizer):
    """A response's output: the reasoning item, the message, the function call (its call_id the
    chat answer's tool call id), as the chat answer splits them; instructions a first system
    turn; the streamed events (the openai client's stream helper accumulates them) end in the
    same response, which GET /v1/responses/{id} returns."""
    async def body(client):
        whole = await client.responses.create(model="fake", input="Weather in Paris?", tools=TOOLS,
                                              instructions="Be brief.")
        events = []
        async with client.responses.stream(model="fake", input="Weather in Paris?", tools=TOOLS) as stream:
            async for ev in stream:
                events.append(ev)
            final = await stream.get_final_response()
        return whole, events, final, await client.responses.retrieve(final.id)

    (whole, events, final, stored), prompts = with_client(tokenizer, ANSWER, body)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "Look it up."
    assert whole.output_text == "Let me check. "
    call = whole.output[2]
    assert (call.name, call.arguments, call.status) == ("get_weather", '{"city": "Paris"}', "completed")
    assert call.call_id and call.id.startswith("fc_")
    assert whole.status == "completed" and whole.object == "response" and whole.instructions == "Be brief."
    assert whole.usage.output_tokens == len(tokenizer(ANSWER)["input_ids"]) + 1  # and EOS
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert prompts[0].startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "Weather in Paris?" in prompts[0] and "get_weather" in prompts[0]  # the tools reach the template

    kinds = [ev.type for ev in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert [ev.item.type for ev in events if ev.type == "response.output_item.done"] == \
        ["reasoning", "message", "function_call"]
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    args = "".join(ev.delta for ev in events if ev.type == "response.function_call_arguments.delta")
    assert (text, args) == ("Let me check. ", '{"city": "Paris"}')
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == whole.output_text and final.output[2].arguments == call.arguments
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert stored.id == final.id and stored.output[2].call_id == final.output[2].call_id


def test_previous_response_id_carries_the_conversation(tokenizer):
    """previous_response_id: the next prompt holds the stored response's input and its answer's
    call, then the new input (a function_call_output, the tool's turn); its instructions are not
    carried over (OpenAI's rule). An unknown id, or a response made with store false, is a 404."""
    async def body(client):
        first = await client.responses.create(model="fake", input="Weather in Paris?", tools=TOOLS,
                                              instructions="Be brief.")
        call = first.output[-1]
        second = await client.responses.create(
            model="fake", previous_response_id=first.id, tools=TOOLS,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
        unstored = await client.responses.create(model="fake", input="Hi", store=False)
        errors = []
        for rid in ("resp_nope", unstored.id):
            try:
                await client.responses.create(model="fake", input="Hi", previous_response_id=rid)
            except openai.NotFoundError as e:
                errors.append(e.body)
        return first, second, errors

    (first, second, errors), prompts = with_client(tokenizer, ANSWER, body)
    assert second.previous_response_id == first.id and second.status == "completed"
    later = prompts[1]
    assert "Be brief." not in later
    asked, called, answered = (later.index("Weather in Paris?"), later.index('"city": "Paris"'),
                               later.index("Sunny, 21 C"))
    assert asked < called < answered
    assert later.count("<tool_response>") == 1  # the tool output's turn (this template's shape)
    assert len(errors) == 2 and all(e["param"] == "previous_response_id" for e in errors)


def test_input_items_listed_and_a_response_deleted_through_the_openai_client(tokenizer):
    """client.responses.input_items.list: a response's own input items (not its predecessor's),
    each with an id, a string input as one user message with an input_text part; newest first by
    default, asc in input order, paged by limit and after. client.responses.delete: then a 404,
    for retrieve and as previous_response_id."""
    async def body(client):
        first = await client.responses.create(model="fake", input="Weather in Paris?", tools=TOOLS)
        call = first.output[-1]
        second = await client.responses.create(
            model="fake", previous_response_id=first.id, tools=TOOLS, input=[
                {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
                {"role": "user", "content": "And tomorrow?"}])
        listed = {"first": await client.responses.input_items.list(first.id),
                  "desc": await client.responses.input_items.list(second.id),
                  "asc": await client.responses.input_items.list(second.id, order="asc")}
        page = await client.responses.input_items.list(second.id, order="asc", limit=1)
        rest = await client.responses.input_items.list(second.id, order="asc", after=page.data[0].id)
        await client.responses.delete(first.id)
        gone = []
        for call_ in (lambda: client.responses.retrieve(first.id),
                      lambda: client.responses.create(model="fake", input="Hi",
                                                      previous_response_id=first.id),
                      lambda: client.responses.delete(first.id)):
            try:
                await call_()
            except openai.NotFoundError as e:
                gone.append(e.status_code)
        kept = await client.responses.retrieve(second.id)
        return listed, page, rest, gone, kept

    (listed, page, rest, gone, kept), _ = with_client(tokenizer, ANSWER, body)
    (only,) = listed["first"].data
    assert (only.type, only.role, only.content[0].type, only.content[0].text) == (
        "message", "user", "input_text", "Weather in Paris?")
    assert [i.type for i in listed["asc"].data] == ["function_call_output", "message"]
    assert [i.id for i in listed["desc"].data] == [i.id for i in listed["asc"].data][::-1]
    assert all(i.id for i in listed["asc"].data) and listed["asc"].data[1].content[0].text == "And tomorrow?"
    assert len(page.data) == 1 and page.has_more and [i.id for i in rest.data] == [listed["asc"].data[1].id]
    assert not rest.has_more and gone == [404, 404, 404] and kept.status == "completed"


def test_max_output_tokens_and_requests_this_server_cannot_answer(tokenizer):
    """max_output_tokens: a cut answer is incomplete (reason max_output_tokens); tools [] is none;
    input images, tools other than functions, a background response not stored and truncation
    "auto" are 400s naming the field."""
    async def body(client):
        cut = await client.responses.create(model="fake", input="Hi", max_output_tokens=2)
        # an empty tools list is no tools (OpenAI's Responses API takes it; the Agents SDK sends it)
        assert (await client.responses.create(model="fake", input="Hi", tools=[])).status == "completed"
        # tool_choice auto (or none) without tools: nothing to choose (vLLM's), not a 400
        auto = await client.responses.create(model="fake", input="Hi", tool_choice="auto")
        assert auto.status == "completed"
        refused = []
        for kw in ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                   {"input": "Hi", "tools": [{"type": "web_search"}]},
                   {"input": "Hi", "background": True, "store": False},
                   {"input": "Hi", "truncation": "auto"},
                   {"input": [{"type": "item_reference", "id": "x"}]}):
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="fake", **kw)
            refused.append(e.value.body["param"])
        return cut, refused

    (cut, refused), _ = with_client(tokenizer, "Hello there, friend.", body, reasoning=None)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2 and cut.output_text
    assert refused == ["input", "tools", "background", "truncation", "input"]


def slow_app(tokenizer) -> tuple:
    """(engine, app, decoder) answering a long text, a round every 20 ms of 3 tokens: a long
    answer takes seconds, so a client asks while it answers."""
    from test_server import ScriptedDecoder

    from eagle_infer.server import Engine, Metrics, ServerConfig, create_app

    class Slow(ScriptedDecoder):
        def step(self):
            time.sleep(0.02)
            return super().step()

    eos = tokenizer.eos_token_id
    long = " ".join(["The weather is fine."] * 60)
    decoder = Slow(list(tokenizer(long, add_special_tokens=False)["input_ids"]) + [eos])
    engine = Engine(decoder, tokenizer, Metrics(1), speculative=True)
    app = create_app(engine, tokenizer, {eos}, ServerConfig(["fake"], None, 2048, len(tokenizer)))
    return engine, app, decoder


async def until(client, rid: str, status: str):
    """The response once it has this status (polled every 10 ms, for up to 10 s)."""
    for _ in range(1000):
        got = await client.responses.retrieve(rid)
        if got.status == status:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never {status}: {got.status}")


def test_background_responses_answer_apart_and_cancel(tokenizer):
    """background: the create call returns at once, queued; the response is retrieved as it goes
    (in progress, then completed with the answer a foreground request gets) and only then goes on
    as previous_response_id; a cancel stops one still answering (cancelled, its sequence dropped
    from the batch), returns a finished one as it is, and refuses a foreground response; a deleted
    one stops answering."""
    engine, app, decoder = slow_app(tokenizer)

    async def drained() -> list:  # the decoder's sequences once none is left (or after 5 s)
        for _ in range(500):
            if not decoder.seqs:
                break
            await asyncio.sleep(0.01)
        return list(decoder.seqs)

    async def body(client):
        queued = await client.responses.create(model="fake", input="Hi", background=True,
                                               max_output_tokens=60)
        running = await until(client, queued.id, "in_progress")
        items_running = await client.responses.input_items.list(queued.id)
        with pytest.raises(openai.BadRequestError) as early:  # no answer yet to go on from
            await client.responses.create(model="fake", input="And?", previous_response_id=queued.id)
        done = await until(client, queued.id, "incomplete")
        items_done = await client.responses.input_items.list(queued.id)
        foreground = await client.responses.create(model="fake", input="Hi", max_output_tokens=60)
        follow = await client.responses.create(model="fake", input="And?", previous_response_id=queued.id)
        again = await client.responses.cancel(queued.id)
        long_one = await client.responses.create(model="fake", input="Hi", background=True)
        await until(client, long_one.id, "in_progress")
        cancelled = await client.responses.cancel(long_one.id)
        stored = await client.responses.retrieve(long_one.id)
        left = await drained()  # the cancelled sequence leaves the batch
        refused = []
        for call in (lambda: client.responses.cancel(foreground.id),
                     lambda: client.responses.retrieve(foreground.id, stream=True)):  # no background stream
            with pytest.raises(openai.BadRequestError) as e:
                await call()
            refused.append(e.value.body["param"])
        doomed = await client.responses.create(model="fake", input="Hi", background=True)
        await until(client, doomed.id, "in_progress")
        await client.responses.delete(doomed.id)
        same_items = [i.id for i in items_running.data] == [i.id for i in items_done.data]
        return (queued, running, early.value, done, foreground, follow, again, cancelled, stored, left,
                refused, await drained(), same_items)

    (queued, running, early, done, foreground, follow, again, cancelled, stored, left, refused,
     after_delete, same_items) = run_with_client(engine, app, body)
    assert same_items  # its input items keep their ids from state to state
    assert queued.status == "queued" and queued.background and queued.output == []
    assert running.status == "in_progress" and running.id == queued.id
    assert early.body["param"] == "previous_response_id" and "in_progress" in early.body["message"]
    assert done.output_text == foreground.output_text and done.usage.output_tokens == 60
    assert done.incomplete_details.reason == "max_output_tokens" and follow.status == "completed"
    assert again.status == "incomplete" and again.output_text == done.output_text
    assert cancelled.status == "cancelled" and stored.status == "cancelled" and left == []
    assert refused == ["response_id", "stream"] and after_delete == []


def test_a_background_stream_resumes_after_a_sequence_number(tokenizer):
    """background with stream: the create call streams the events (stored incomplete at 60 tokens,
    the foreground answer's text); retrieve with stream and starting_after gives the events after
    that sequence number up to response.completed, none lost or twice; without starting_after, all
    of them again; a deleted response's events are gone with it. (The in-process transport reads
    a whole stream before the client sees it: test_server's real server drops one midway.)"""
    engine, app, _ = slow_app(tokenizer)

    async def body(client):
        stream = await client.responses.create(model="fake", input="Hi", background=True, stream=True,
                                               max_output_tokens=60)
        first = []
        async for event in stream:
            first.append(event)
            if len(first) == 6:
                break
        await stream.close()
        rid = first[0].response.id
        after = first[-1].sequence_number
        resumed = [e async for e in await client.responses.retrieve(rid, stream=True, starting_after=after)]
        again = [e async for e in await client.responses.retrieve(rid, stream=True)]
        done = await client.responses.retrieve(rid)
        foreground = await client.responses.create(model="fake", input="Hi", max_output_tokens=60)
        await client.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(rid, stream=True)
        return first, resumed, again, done, foreground

    first, resumed, again, done, foreground = run_with_client(engine, app, body)
    assert [e.type for e in first[:2]] == ["response.created", "response.in_progress"]
    seen = first + resumed
    assert [e.sequence_number for e in seen] == list(range(len(seen)))  # none lost, none twice
    assert [(e.sequence_number, e.type) for e in again] == [(e.sequence_number, e.type) for e in seen]
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert resumed[-1].type == "response.completed" and resumed[-1].response.status == "incomplete"
    assert text == foreground.output_text == done.output_text and done.status == "incomplete"
    assert done.usage.output_tokens == 60 and done.background


def test_a_background_response_whose_answer_breaks_is_stored_failed(tokenizer, monkeypatch):
    """An error while a background response is shaped leaves it failed (server_error, the error's
    text), not in progress for ever, and the server answers the next request."""
    from eagle_infer.responses_api import ResponseShape

    def broken(self, answer):
        raise RuntimeError("shape broken")

    async def body(client):
        with monkeypatch.context() as m:
            m.setattr(ResponseShape, "whole", broken)
            started = await client.responses.create(model="fake", input="Hi", background=True)
            for _ in range(500):
                got = await client.responses.retrieve(started.id)
                if got.status not in ("queued", "in_progress"):
                    break
                await asyncio.sleep(0.01)
        return got, await client.responses.create(model="fake", input="Hi")

    (failed, after), _ = with_client(tokenizer, "Hello there.", body, reasoning=None)
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "shape broken" in failed.error.message and after.status == "completed"


def test_input_items_become_chat_turns(tokenizer):
    """Input items: messages with text parts (input_text, and an earlier answer's output_text),
    a function_call then its output, and reasoning items (dropped, as templates drop old
    reasoning) make the chat turns the template gets; a developer turn is a system one here."""
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Nice"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Rain"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Il pleut."}]},
             {"role": "user", "content": "Merci"}]

    async def body(client):
        return await client.responses.create(model="fake", input=items, tools=TOOLS)

    answer, prompts = with_client(tokenizer, "De rien.", body, reasoning=None)
    assert answer.output_text == "De rien." and [o.type for o in answer.output] == ["message"]
    prompt = prompts[0]
    assert prompt.startswith("<|im_start|>system\nAnswer in French.")
    order = [prompt.index(s) for s in ("Weather?", '"city": "Nice"', "Rain", "Il pleut.", "Merci")]
    assert order == sorted(order)


def test_calls_join_their_turn_without_touching_the_stored_history():
    """Consecutive function_call items are one assistant turn's calls, an assistant's text and its
    calls one turn too; a call added to a history's last turn leaves the stored history as it was."""
    from eagle_infer.responses_api import ResponsesRequest

    def call(i: int) -> dict:
        return {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}

    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Let me see.", "tool_calls": [
                   {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    kept = [dict(m) for m in history]
    msgs = ResponsesRequest(input=[call(1), {"type": "function_call_output", "call_id": "c1", "output": "x"},
                                   call(2), call(3)]).conversation(history)
    assert history == kept and len(history[1]["tool_calls"]) == 1
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c0", "c1"] and msgs[1]["content"] == "Let me see."
    assert [c["id"] for c in msgs[3]["tool_calls"]] == ["c2", "c3"] and msgs[3]["content"] is None



def test_a_call_cut_by_max_output_tokens_is_incomplete():
    """A chat answer whose last call max_output_tokens cut: the response incomplete, that call's
    item too (its arguments are not whole: an agent must not run it)."""
    from eagle_infer.api_schema import ChatRequest
    from eagle_infer.responses_api import ResponseShape, ResponsesRequest, ResponseStore

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Pa'}}
    answer = {"choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "length",
                           "logprobs": None}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 9}}
    chat = ChatRequest(messages=[{"role": "user", "content": "Hi"}])
    shape = ResponseShape(ResponsesRequest(input="Hi"), chat, [], "m", ResponseStore())
    out = shape.whole(answer)
    assert out["status"] == "incomplete" and [(o["type"], o["status"]) for o in out["output"]] == [
        ("function_call", "incomplete")]


def test_input_item_pages_by_before_and_refused_bounds():
    from eagle_infer.api_schema import ApiError
    from eagle_infer.responses_api import page_of

    items = [{"id": f"i{k}"} for k in range(5)]
    ids = lambda page: [i["id"] for i in page["data"]]  # noqa: E731
    assert ids(page_of(items, 20, "desc", None, "i1")) == ["i4", "i3", "i2"]
    middle = page_of(items, 2, "asc", "i0", "i4")
    assert ids(middle) == ["i1", "i2"] and middle["has_more"]
    assert page_of(items, 20, "asc", "i4", None) == {"object": "list", "data": [], "first_id": None,
                                                     "last_id": None, "has_more": False}
    for args, param in (((0, "asc", None, None), "limit"), ((101, "asc", None, None), "limit"),
                        ((5, "up", None, None), "order"), ((5, "asc", "nope", None), "after")):
        with pytest.raises(ApiError) as err:
            page_of(items, *args)
        assert err.value.status == 400 and err.value.param == param


def test_a_stream_that_fails_ends_in_an_error_event(tokenizer):
    """A decode round that fails mid-answer ends a stream with an `error` event numbered after the
    events before it; a background stream whose prefill fails gives its response (the id to
    retrieve it by), then the error, and the stored response is failed with the error's message."""
    from eagle_infer.server import ServerConfig

    engine, app = scripted_app(tokenizer, "Hello there, how are you today? Fine.",
                               ServerConfig(["fake"], None, 2048, len(tokenizer)))
    dec = engine.dec
    step, add_many, rounds = dec.step, dec.add_many, []

    def failing_step():
        rounds.append(1)
        if len(rounds) == 2:
            raise RuntimeError("round broken")
        return step()

    def failing_add(seqs):
        raise RuntimeError("prefill broken")

    async def body(client):
        dec.step = failing_step
        streamed = [e async for e in await client.responses.create(model="fake", input="Hi", stream=True)]
        dec.step, dec.add_many = step, failing_add
        background = [e async for e in await client.responses.create(model="fake", input="Hi", stream=True,
                                                                     background=True)]
        dec.add_many = add_many
        stored = await client.responses.retrieve(background[0].response.id)
        again = [e async for e in await client.responses.retrieve(stored.id, stream=True)]
        return streamed, background, stored, again, await client.responses.create(model="fake", input="Hi")

    streamed, background, stored, again, after = run_with_client(engine, app, body)
    assert streamed[-1].type == "error" and "round broken" in streamed[-1].message
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert any(e.type == "response.output_text.delta" for e in streamed)  # it failed mid-answer
    assert [(e.type, e.sequence_number) for e in background] == [("response.created", 0), ("error", 1)]
    assert "prefill broken" in background[1].message and background[1].code
    assert stored.status == "failed" and stored.error.message == background[1].message
    assert [e.type for e in again] == ["response.created", "error"]
    assert after.status == "completed" and after.output_text == "Hello there, how are you today? Fine."
