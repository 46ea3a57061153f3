"""Tool calling's pieces without a server: the parsers of "auto" answers (vLLM's hermes and
llama3_json formats), "required"'s schema, the streamed deltas, the request's checks, and the
shipped chat template that shows tools to SmolLM2 (the server's answers: test_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle_infer.api_schema import ApiError, ChatRequest, Message
from eagle_infer.tool_calls import (
    PARSERS,
    ToolPlan,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parse_phi4_mini_json,
    parse_pythonic,
    parse_required,
    required_schema,
)

TEMPLATE = Path(__file__).resolve().parents[1] / "conf" / "chat_templates" / "smollm2_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def test_hermes_calls_and_the_content_before_them():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}')  # the last one cut short
    assert parse_hermes(text) == ("Let me check.",
                                  [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    assert parse_hermes("<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": \"é\"}}</tool_call>") == (
        None, [("f", '{"x": "é"}')])  # no content; non-ASCII kept (vLLM's ensure_ascii=False)
    for plain in ("No tools needed.", "<tool_call>{not json}</tool_call>", '<tool_call>{"name": "f"}'):
        assert parse_hermes(plain) == (plain, [])  # nothing that parses: all content


def test_llama3_json_calls():
    two = '<|python_tag|>{"name": "a", "parameters": {"q": 1}}; {"name": "b", "arguments": {"r": [2]}}'
    assert parse_llama3_json(two) == (None, [("a", '{"q": 1}'), ("b", '{"r": [2]}')])
    nested = '{"name": "a", "parameters": {"inner": {"name": "x", "parameters": {}}}}'
    assert parse_llama3_json(nested) == (None, [("a", '{"inner": {"name": "x", "parameters": {}}}')])
    for plain in ("Just text.", "A set {1, 2} is not a call.", '{"answer": 42}'):
        assert parse_llama3_json(plain) == (plain, [])


def test_pythonic_calls():
    """vLLM's pythonic format (Llama 3.2 / 4): a list of calls by keyword with literal values, in
    Llama 4's python tags or not; anything else is content, and nothing is run."""
    two = '[get_weather(city="Paris", days=[1, 2], opts={"unit": "c"}, hourly=True), get_time()]'
    calls = [("get_weather", '{"city": "Paris", "days": [1, 2], "opts": {"unit": "c"}, "hourly": true}'),
             ("get_time", "{}")]
    assert parse_pythonic(two) == (None, calls)
    assert parse_pythonic(f"<|python_start|>{two}<|python_end|>") == (None, calls)
    assert parse_pythonic(" [f(x=None, y='é')]\n") == (None, [("f", '{"x": null, "y": "é"}')])
    for plain in ("Just text.", "[1, 2, 3]", "[f(1)]", "[f(x=g())]", "[f(x={1, 2})]", "[f(**kw)]",
                  "[__import__(name='os')] and more", "[f(x=1)", "[]"):
        assert parse_pythonic(plain) == (plain, [])
    assert PARSERS["llama4_pythonic"] is PARSERS["pythonic"]
    # streamed: an answer that opens as a list is held whole; one that does not is content
    plan = ToolPlan("auto", parser=PARSERS["pythonic"])
    deltas, finish = stream_deltas(plan, ["[get_weather(", 'city="Rome")]'], "stop")
    assert [list(d) for d in deltas] == [["tool_calls"]] and finish == "tool_calls"
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    deltas, finish = stream_deltas(plan, ["It is", " [sunny]"], "stop")
    assert [d["content"] for d in deltas] == ["It is", " [sunny]"] and finish == "stop"


def test_phi4_mini_json_calls():
    """vLLM's phi4_mini_json format: `functools[...]`, a JSON list of calls read to its end (nested
    brackets too, where vLLM's regex stops at the first `]`), the text before it the content."""
    text = 'Sure. functools[{"name": "a", "arguments": {"xs": [1, [2]]}}, {"name": "b", "parameters": {}}]'
    assert parse_phi4_mini_json(text) == ("Sure. ", [("a", '{"xs": [1, [2]]}'), ("b", "{}")])
    assert parse_phi4_mini_json(text[6:]) == (None, [("a", '{"xs": [1, [2]]}'), ("b", "{}")])
    for plain in ("No call.", "functools[{not json}]", 'functools[{"arguments": {}}]', "functools[]"):
        assert parse_phi4_mini_json(plain) == (plain, [])
    plan = ToolPlan("auto", parser=PARSERS["phi4_mini_json"])
    deltas, finish = stream_deltas(plan, [text[i:i + 4] for i in range(0, len(text), 4)], "stop")
    assert "".join(d.get("content", "") for d in deltas) == "Sure. " and finish == "tool_calls"
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["a", "b"]


MISTRAL_FORMATS = {  # one answer, two calls, in each tokenizer version's format
    "v3": 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par\\"is", "days": [1, [2]]}}, '
          '{"name": "get_time", "arguments": {}}]',
    "v11": 'Sure. [TOOL_CALLS]get_weather{"city": "Par\\"is", "days": [1, [2]]}[TOOL_CALLS]get_time{}',
    "v13": 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Par\\"is", "days": [1, [2]]}'
           '[TOOL_CALLS]get_time[ARGS]{}',
}


@pytest.mark.parametrize("version", sorted(MISTRAL_FORMATS))
def test_mistral_calls_in_each_tokenizer_versions_format(version):
    """vLLM's mistral format after the [TOOL_CALLS] token (kept in the text: tools keep special
    tokens): a JSON list (before v11), name{...} (v11) or name[ARGS]{...} (v13), the text before
    it the content; call ids of 9 letters and digits, as Mistral's templates require back. v11's
    and v13's calls stream their name, then their arguments (the whole answer's, added up, at
    any cut); the list comes whole at the end."""
    text = MISTRAL_FORMATS[version]
    want = [("get_weather", '{"city": "Par\\"is", "days": [1, [2]]}'), ("get_time", "{}")]
    assert parse_mistral(text) == ("Sure. ", want)
    assert parse_mistral(text[6:]) == (None, want)
    for plain in ("No call.", "[TOOL_CALLS]", "[TOOL_CALLS]f", "[TOOL_CALLS]f[1]", "[TOOL_CALLS][{not json}]",
                  '[TOOL_CALLS][{"arguments": {}}]', "[TOOL_CALLS]f{}x[TOOL_CALLS]", '[TOOL_CALLS]f"x"'):
        assert parse_mistral(plain) == (plain, []), plain
    plan = ToolPlan("auto", parser=PARSERS["mistral"])
    whole, whole_finish = plan.message(text, "stop")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == want
    for size in (1, 4, 1000):
        deltas, finish = stream_deltas(plan, [text[i:i + size] for i in range(0, len(text), size)], "stop")
        assert finish == whole_finish == "tool_calls"
        assert "".join(d.get("content", "") for d in deltas) == "Sure. "
        got = calls_of(deltas)
        assert [(n, a) for _, n, a in got] == want
        assert all(len(i) == 9 and i.isalnum() for i, _, _ in got)
        if size == 1:  # v11 / v13: the first call's name before its arguments; the list: whole at the end
            first = next(k for k, d in enumerate(deltas) if "tool_calls" in d)
            assert (first == len(deltas) - 1) == (version == "v3")
    for k in range(len(text)):  # every prefix: what went out is a prefix of the whole arguments
        got = calls_of(stream_deltas(plan, [text[:k]], "length")[0])
        if got:
            assert want[len(got) - 1][1].startswith(got[-1][2]), text[:k]


def test_required_schema_lists_each_tool_and_gathers_defs():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    a = {"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}}}
    schema = required_schema([a, TIME], parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"Point": point}
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["a"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert a["function"]["parameters"]["$defs"] == {"Point": point}  # the request's tools untouched
    assert required_schema([a], parallel=False)["maxItems"] == 1
    other = json.loads(json.dumps(a).replace('"number"', '"string"'))
    other["function"]["name"] = "b"
    with pytest.raises(ValueError, match="Point"):
        required_schema([a, other], parallel=True)


def test_required_answers_and_the_messages_each_mode_makes():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    assert parse_required(text) == (None, [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])
    assert parse_required('[{"name": "get_weather", "parameters": {"ci') == (None, [])  # cut by max_tokens
    fields, finish = ToolPlan("required").message(text, "stop")
    assert finish == "tool_calls" and fields["content"] == ""
    assert [(c["type"], c["function"]["name"]) for c in fields["tool_calls"]] == [
        ("function", "get_weather"), ("function", "get_time")]
    assert len({c["id"] for c in fields["tool_calls"]}) == 2 and fields["tool_calls"][0]["id"].startswith(
        "chatcmpl-tool-")
    assert ToolPlan("required").message(text[:20], "length")[1] == "length"
    fields, finish = ToolPlan("named", name="get_weather").message('{"city": "Oslo"}', "stop")
    assert finish == "stop" and fields["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                        "arguments": '{"city": "Oslo"}'}
    auto = ToolPlan("auto", parser=PARSERS["hermes"])
    assert auto.message("Hello there.", "stop") == ({"content": "Hello there."}, "stop")
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    fields, finish = auto.message("Sure. " + call, "stop")
    assert finish == "tool_calls" and fields["content"] == "Sure. "


def stream_deltas(plan: ToolPlan, pieces: list[str], finish: str) -> tuple[list[dict], str | None]:
    s = plan.stream()
    deltas = [d for d in (s.feed(p) for p in pieces) if d is not None]
    last, finish = s.end(finish)
    return deltas + ([last] if last else []), finish


def test_streamed_deltas_add_up_to_the_whole_answer():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "Let me look that up. " + call
    # cut inside the start tag: "<tool" must never be sent as content
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    deltas, finish = stream_deltas(ToolPlan("auto", parser=PARSERS["hermes"]), pieces, "stop")
    assert "".join(d.get("content", "") for d in deltas) == "Let me look that up. "
    assert all("<" not in d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert finish == "tool_calls"
    named = [(c["index"], c["function"]["name"]) for c in calls if "name" in c["function"]]
    assert named == [(0, "get_weather")]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    # text that only looked like the start of a tag is content after all
    deltas, finish = stream_deltas(ToolPlan("auto", parser=PARSERS["hermes"]), ["a <tool", "s b"], "stop")
    assert "".join(d["content"] for d in deltas) == "a <tools b" and finish == "stop"
    # llama3_json: an answer that opens as a call is held whole; text that does not is streamed
    plan = ToolPlan("auto", parser=PARSERS["llama3_json"])
    deltas, finish = stream_deltas(plan, ['{"name": "a", ', '"parameters": {}}'], "stop")
    assert deltas == [{"tool_calls": [deltas[0]["tool_calls"][0]]}] and finish == "tool_calls"
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "a", "arguments": "{}"}
    deltas, _ = stream_deltas(plan, ["Hi", " {there}"], "stop")
    assert [d["content"] for d in deltas] == ["Hi", " {there}"]
    deltas, finish = stream_deltas(plan, ["{not", " a call"], "length")
    assert deltas == [{"content": "{not a call"}] and finish == "length"
    # named: the arguments stream as they come, the id and name once
    deltas, finish = stream_deltas(ToolPlan("named", name="f"), ["", '{"x"', ": 1}"], "stop")
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "f", "arguments": '{"x"'}
    assert first["id"].startswith("chatcmpl-tool-")
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]} and finish == "stop"
    # required: the calls whole at the end
    deltas, finish = stream_deltas(ToolPlan("required"), ['[{"name": "f", ', '"parameters": {}}]'], "stop")
    assert len(deltas) == 1 and deltas[0]["tool_calls"][0]["function"]["name"] == "f"
    assert finish == "tool_calls"


def calls_of(deltas: list[dict]) -> list[tuple[str, str, str]]:
    """The streamed calls as a client adds them up: (id, name, arguments) by index."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], ["", "", ""])
            entry[0] += c.get("id", "")
            entry[1] += c.get("function", {}).get("name", "")
            entry[2] += c.get("function", {}).get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_calls_stream_their_name_then_their_arguments(size):
    """In hermes' envelope a call streams as vLLM's hermes parser streams it: the id and name once
    its head is written, then the arguments as they come; added up, the calls a whole answer's
    message holds, in any cut of the text; a call not written as {"name", "arguments"} comes
    whole at the end."""
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {\n'
             '  "city": "Par\\"is} \\u00e9\\ud83d\\ude00\\\\",\n'
             '  "n":[1,{"a" : 2.50e1, "b": true}], "s": "\\/"}}\n</tool_call>\n'
             '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    text = "Let me look. " + calls
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    whole, whole_finish = ToolPlan("auto", parser=PARSERS["hermes"]).message(text, "stop")
    for plan in (ToolPlan("auto", parser=PARSERS["hermes"]), ToolPlan("required", parser=PARSERS["hermes"])):
        deltas, finish = stream_deltas(plan, pieces, "stop")
        assert finish == whole_finish == "tool_calls"
        got = calls_of(deltas)
        # as a whole answer's: json.dumps' form of what the model wrote (pretty-printed, escapes)
        assert [(n, a) for _, n, a in got] == [(c["function"]["name"], c["function"]["arguments"])
                                               for c in whole["tool_calls"]]
        assert json.loads(got[0][2])["city"] == 'Par"is} \u00e9\U0001F600\\'
        assert all(i.startswith("chatcmpl-tool-") and len(i) > 20 for i, _, _ in got)  # an id each, once
        content = "".join(d.get("content", "") for d in deltas)
        assert content == ("Let me look. " if plan.mode == "auto" else "")
        if size == 1:  # each call's name went out before its arguments were whole
            names = [k for k, d in enumerate(deltas)
                     if any("name" in c["function"] for c in d.get("tool_calls", []))]
            assert len(names) == 2 and names[0] < len(deltas) - 40
    # cut short by max_tokens: what came went out, the finish reason stays "length"
    cut = text[:text.index("Par")]
    deltas, finish = stream_deltas(ToolPlan("auto", parser=PARSERS["hermes"]),
                                   [cut[i:i + size] for i in range(0, len(cut), size)], "length")
    assert finish == "length" and calls_of(deltas)[0][1:] == ("get_weather", '{"city": "')
    for k in range(len(text)):  # every prefix: what went out is a prefix of the whole arguments
        got = calls_of(stream_deltas(ToolPlan("auto", parser=PARSERS["hermes"]), [text[:k]], "length")[0])
        if got:
            assert whole["tool_calls"][0]["function"]["arguments"].startswith(got[0][2]), text[:k]
    # other orders, or arguments that are not an object: whole at the end, as parsed
    for odd in ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',
                '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'):
        deltas, finish = stream_deltas(ToolPlan("auto", parser=PARSERS["hermes"]), list(odd), "stop")
        whole, _ = ToolPlan("auto", parser=PARSERS["hermes"]).message(odd, "stop")
        assert len(deltas) == 1 and calls_of(deltas)[0][1:] == (
            whole["tool_calls"][0]["function"]["name"], whole["tool_calls"][0]["function"]["arguments"])


def test_llama3_json_calls_stream_their_name_then_their_arguments():
    """llama3_json's calls stream too (vLLM's llama3_json parser streams them): after the python
    tag, each object's name once written, then its "parameters"; added up, the whole answer's."""
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city" : "Rome", "days": [1,2]}};\n'
            '{"name": "get_time", "arguments": {}}')
    plan = ToolPlan("auto", parser=PARSERS["llama3_json"])
    whole, whole_finish = plan.message(text, "stop")
    deltas, finish = stream_deltas(plan, list(text), "stop")
    assert finish == whole_finish == "tool_calls" and not any("content" in d for d in deltas)
    assert [(n, a) for _, n, a in calls_of(deltas)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert [(n, a) for _, n, a in calls_of(deltas)][0] == ("get_weather", '{"city": "Rome", "days": [1, 2]}')
    first = next(k for k, d in enumerate(deltas) if "tool_calls" in d)
    assert first < text.index("Rome")  # the name went out before the arguments were whole
    # not calls after all: content, whole at the end, as before
    for other in ("{there}", "{not a call", "Hi {there}"):
        deltas, finish = stream_deltas(plan, list(other), "stop")
        assert "".join(d.get("content", "") for d in deltas) == other and not calls_of(deltas)


def request(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]} | kw)


def test_tool_choice_checks():
    hermes = PARSERS["hermes"]
    assert request().tool_plan(hermes, True) is None
    assert request(tools=[WEATHER], tool_choice="none").tool_plan(hermes, True) is None
    assert request(tools=[WEATHER]).tool_plan(hermes, True) == ToolPlan("auto", parser=hermes)  # OpenAI's
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = request(tools=[WEATHER], tool_choice=named).tool_plan(None, False)
    assert plan == ToolPlan("named", "get_weather")
    assert request(tools=[WEATHER], tool_choice="required").tool_plan(hermes, False) == ToolPlan(
        "required", parser=hermes)
    bad = [({"tools": []}, hermes, True, "tools"),
           ({"tool_choice": "required"}, hermes, True, "tool_choice"),
           ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, hermes,
            True, "tool_choice"),
           ({"tools": [WEATHER]}, None, True, "tool_choice"),  # "auto" without a parser
           ({"tools": [WEATHER]}, hermes, False, "tool_choice"),  # ... or without --enable-auto-tool-choice
           ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            hermes, True, "response_format")]
    for kw, parser, auto, param in bad:
        with pytest.raises(ApiError) as e:
            request(**kw).tool_plan(parser, auto)
        assert e.value.status == 400 and e.value.param == param, kw
    # "auto" with a structured output is the caller's business (vLLM's too)
    assert request(tools=[WEATHER], guided_regex="a").tool_plan(hermes, True).mode == "auto"


def test_forced_calls_in_the_parsers_envelope(tokenizer):
    """With the hermes parser a forced call is written as vLLM 0.32 has it written: a
    <tool_call> tag (either of its two forms) around {"name": the function, "arguments": its
    schema}; the grammar takes those and nothing else, and the parser reads the calls back."""
    import xgrammar as xgr

    from eagle_infer.grammar import Grammars

    plan = ToolPlan("named", "get_weather", PARSERS["hermes"])
    kind, tag = plan.grammar([WEATHER, TIME], parallel=True)
    fmt = tag["format"]
    assert kind == "structural_tag" and fmt["type"] == "tags_with_separator" and fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ',
                                                 '<tool_call>{"name": "get_weather", "arguments": ']
    assert fmt["tags"][0]["content"]["json_schema"] == WEATHER["function"]["parameters"]
    required = ToolPlan("required", parser=PARSERS["hermes"])
    assert len(required.grammar([WEATHER, TIME], True)[1]["format"]["tags"]) == 4
    assert required.grammar([WEATHER, TIME], True)[1]["format"]["stop_after_first"] is False
    assert required.grammar([WEATHER, TIME], False)[1]["format"]["stop_after_first"] is True
    loose = {"type": "function", "function": WEATHER["function"] | {"strict": False}}
    assert plan.grammar([loose], True)[1]["format"]["tags"][0]["content"]["json_schema"] == {"type": "object"}
    # llama3_json has no envelope: forced calls are bare JSON
    bare = ToolPlan("named", "get_weather", PARSERS["llama3_json"])
    assert bare.grammar([WEATHER], True) == ("json_schema", WEATHER["function"]["parameters"])

    grammar = Grammars.for_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(kind, tag)

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(grammar.compiled)
        ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
        return all(m.accept_token(t) for t in ids)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(call) and accepts(call.replace("\n", ""))
    for wrong in ('{"city": "Oslo"}', call.replace("Oslo", "1").replace('"1"', "1"), call + call):
        assert not accepts(wrong), wrong
    fields, finish = plan.message(call, "stop")
    assert fields["content"] == "" and finish == "stop"
    assert fields["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # "auto": free where no tool is strict; where one is, free text until a call's tag begins
    auto = ToolPlan("auto", parser=PARSERS["hermes"])
    assert auto.grammar([WEATHER], True) is None
    strict = {"type": "function", "function": WEATHER["function"] | {"strict": True}}
    kind, tag = auto.grammar([strict, TIME], True)
    assert tag["format"]["type"] == "triggered_tags" and tag["format"]["triggers"] == ["<tool_call>"]
    assert len(tag["format"]["tags"]) == 4
    grammar = Grammars.for_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(kind, tag)
    assert accepts("Any text at all.") and accepts("Let me see. " + call)
    assert not accepts("Let me see. " + call.replace('"Oslo"', "1"))
    deltas, finish = stream_deltas(plan, [call[:9], call[9:]], "stop")  # whole at the end
    assert len(deltas) == 1 and deltas[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_messages_reach_the_template_as_templates_read_them():
    m = Message.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]})
    msg = m.for_template()
    assert msg["content"] == "" and [c["function"]["arguments"] for c in msg["tool_calls"]] == [{"a": 1}, {}]
    assert m.tool_calls[0]["function"]["arguments"] == '{"a": 1}'  # the request's own copy untouched
    tool = Message.model_validate({"role": "tool", "tool_call_id": "1",
                                   "content": [{"type": "text", "text": "5"}]})
    assert tool.for_template() == {"role": "tool", "content": "5", "tool_call_id": "1"}
    with pytest.raises(ApiError):
        Message.model_validate({"role": "assistant", "tool_calls": [{"type": "code"}]}).for_template()


def test_shipped_template_is_smollm2s_without_tools_and_shows_them_with(tokenizer):
    from eagle_infer.generate import chat_prompt_ids

    template = TEMPLATE.read_text()
    for msgs in ([{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        assert chat_prompt_ids(tokenizer, msgs, chat_template=template) == chat_prompt_ids(tokenizer, msgs)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            Message.model_validate({"role": "assistant", "content": None, "tool_calls": [
                {"id": "x", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}).for_template(),
            {"role": "tool", "tool_call_id": "x", "content": "21 C"}]
    text = tokenizer.decode(chat_prompt_ids(tokenizer, msgs, [WEATHER], template))
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
