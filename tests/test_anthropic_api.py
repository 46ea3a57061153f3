"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on an in-process server
whose answers are scripted (the real tokenizer, our SmolLM2 template with tools, the hermes tool
parser and, where asked, the deepseek_r1 reasoning parser), through raw HTTP as Anthropic's SDK
sends it (the SDK itself: scripts/probe_clients.py)."""

import json
from pathlib import Path

import httpx
from test_server import in_process, scripted_app

TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ANSWER = ('<think>Look it up.</think>Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris"}}\n</tool_call>')


def ask(tokenizer, answer: str, requests: list[tuple[str, dict]], reasoning: str | None = "deepseek_r1",
        api_key: str | None = None, headers: dict | None = None) -> tuple[list[httpx.Response], list[str]]:
    """POST each (path, body) to an in-process server answering `answer`: (the responses, the
    prompts the engine was given, decoded)."""
    from eagle_infer.server import ServerConfig

    template = (Path(__file__).parents[1] / "conf/chat_templates/smollm2_tools.jinja").read_text()
    engine, app = scripted_app(tokenizer, answer, ServerConfig(
        ["claude-local"], api_key, 2048, len(tokenizer), tool_parser="hermes", auto_tools=True,
        reasoning_parser=reasoning, chat_template=template))
    got = in_process(engine, app, [("POST", path, body) for path, body in requests], headers)
    return got, [tokenizer.decode(seq.prompt) for seq in engine.dec.added]


def events(text: str) -> list[tuple[str, dict]]:
    """An SSE body's (event, data) pairs; each data's type is its event's name."""
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name
            out.append((name, data))
    return out


def test_a_message_holds_thinking_text_and_tool_use_whole_and_streamed(tokenizer):
    """The answer's blocks: thinking, text, tool_use (its input an object), stop_reason tool_use;
    the system prompt and the tools reach the template; streamed, Anthropic's events build the
    same blocks (block starts, deltas, stops; message_delta with the stop reason and usage)."""
    body = {"model": "claude-local", "max_tokens": 100, "system": [{"type": "text", "text": "Be brief."}],
            "tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    (whole, streamed), prompts = ask(tokenizer, ANSWER, [("/v1/messages", body),
                                                        ("/v1/messages", body | {"stream": True})])
    assert whole.status_code == 200, whole.text
    msg = whole.json()
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][0]["thinking"] == "Look it up." and msg["content"][1]["text"] == "Let me check. "
    call = msg["content"][2]
    assert (call["name"], call["input"]) == ("get_weather", {"city": "Paris"}) and call["id"]
    assert (msg["type"], msg["role"], msg["stop_reason"], msg["stop_sequence"]) == (
        "message", "assistant", "tool_use", None)
    assert msg["usage"]["output_tokens"] == len(tokenizer(ANSWER)["input_ids"]) + 1  # and EOS
    assert msg["usage"]["input_tokens"] == len(tokenizer(prompts[0])["input_ids"])
    assert prompts[0].startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "get_weather" in prompts[0]

    got = events(streamed.text)
    kinds = [name for name, _ in got]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for name, d in got if name == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use"]
    assert starts[2]["name"] == "get_weather" and starts[2]["input"] == {}
    assert [d["index"] for name, d in got if name == "content_block_stop"] == [0, 1, 2]
    deltas = [d for name, d in got if name == "content_block_delta"]
    pieces = [(d["index"], d["delta"].get("thinking") or d["delta"].get("text") or d["delta"]["partial_json"])
              for d in deltas]
    by_index = {i: "".join(text for at, text in pieces if at == i) for i in range(3)}
    assert by_index == {0: "Look it up.", 1: "Let me check. ", 2: '{"city": "Paris"}'}
    final = got[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == msg["usage"]["output_tokens"]
    assert got[0][1]["message"]["usage"]["input_tokens"] == msg["usage"]["input_tokens"]


def test_tool_results_and_history_blocks_become_chat_turns(tokenizer):
    """An assistant's tool_use blocks are its turn's calls (thinking blocks dropped), a user's
    tool_result blocks tool turns (is_error marked) ahead of the user's text (vLLM's order), text
    blocks on lines of their own; count_tokens counts the prompt a message request gets."""
    messages = [{"role": "user", "content": "Weather in Nice?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hidden", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Nice"}}]},
                {"role": "user", "content": [  # the text first: its turn goes after the tool's
                    {"type": "text", "text": "And now?"},
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "Rain"}, {"type": "text", "text": "Wind"}]}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Nice"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout",
                     "is_error": True}]}]
    body = {"model": "claude-local", "max_tokens": 20, "tools": TOOLS, "messages": messages}
    (answer, counted), prompts = ask(tokenizer, "Sorry.", [
        ("/v1/messages", body), ("/v1/messages/count_tokens", body)], reasoning=None)
    assert answer.json()["content"] == [{"type": "text", "text": "Sorry."}]
    assert answer.json()["stop_reason"] == "end_turn"
    prompt = prompts[0]
    assert "hidden" not in prompt
    order = [prompt.index(s) for s in ("Weather in Nice?", "Checking.", '"city": "Nice"', "Rain\nWind",
                                       "And now?", "Error: timeout")]
    assert order == sorted(order)
    assert counted.json() == {"input_tokens": len(tokenizer(prompt)["input_ids"])}


def test_stops_cuts_and_errors_in_anthropic_shape(tokenizer):
    """stop_sequences: stop_reason stop_sequence naming the one matched; max_tokens cuts:
    stop_reason max_tokens; bad requests (an image block, a server tool, no max_tokens, an
    unknown model, a wrong key) answer in Anthropic's error shape; x-api-key is a key."""
    base = {"model": "claude-local", "max_tokens": 30, "messages": [{"role": "user", "content": "Hi"}]}
    bad = [base | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
           base | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
           {k: v for k, v in base.items() if k != "max_tokens"},
           base | {"model": "claude-opus"}]
    (stopped, cut, *refused), _ = ask(tokenizer, "Red, green. Blue.", [
        ("/v1/messages", base | {"stop_sequences": ["@", "."]}), ("/v1/messages", base | {"max_tokens": 2}),
        *[("/v1/messages", b) for b in bad]], reasoning=None, api_key="k", headers={"x-api-key": "k"})
    assert stopped.json()["content"][0]["text"] == "Red, green"
    assert (stopped.json()["stop_reason"], stopped.json()["stop_sequence"]) == ("stop_sequence", ".")
    assert cut.json()["stop_reason"] == "max_tokens" and cut.json()["usage"]["output_tokens"] == 2
    assert [r.status_code for r in refused] == [400, 400, 400, 404]
    assert [r.json()["error"]["type"] for r in refused] == ["invalid_request_error"] * 3 + ["not_found_error"]
    assert all(r.json()["type"] == "error" for r in refused)
    assert "image" in refused[0].json()["error"]["message"]
    assert "web_search" in refused[1].json()["error"]["message"]
    (wrong,), _ = ask(tokenizer, "Hi", [("/v1/messages", base)], reasoning=None, api_key="k",
                      headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"


def test_a_named_tool_answer_stops_in_tool_use(tokenizer):
    """tool_choice {"type": "tool"}: the answer is a call of the named tool (decoded under its
    schema, as a chat request's named function), stop_reason tool_use whole and streamed (the chat
    answer finishes with stop there, as OpenAI's)."""
    body = {"model": "claude-local", "max_tokens": 40, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    call = ANSWER[ANSWER.index("<tool_call>"):]  # the hermes parser's envelope, as vLLM 0.32 forces it
    (whole, streamed), _ = ask(tokenizer, call, [
        ("/v1/messages", body), ("/v1/messages", body | {"stream": True})], reasoning=None)
    assert [(b["type"], b["input"]) for b in whole.json()["content"]] == [("tool_use", {"city": "Paris"})]
    assert whole.json()["stop_reason"] == "tool_use"
    assert events(streamed.text)[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_an_empty_answer_is_one_empty_text_block(tokenizer):
    """An answer of nothing (EOS first): content [{"type": "text", "text": ""}], as vLLM answers
    (clients read content[0])."""
    body = {"model": "claude-local", "max_tokens": 20, "messages": [{"role": "user", "content": "Hi"}]}
    (answer,), _ = ask(tokenizer, "", [("/v1/messages", body)], reasoning=None)
    assert answer.json()["content"] == [{"type": "text", "text": ""}]
    assert answer.json()["stop_reason"] == "end_turn"


def test_thinking_off_and_client_metadata_as_vllm_reads_them():
    """thinking {"type": "disabled"} is Qwen3's template switch enable_thinking false (a request's
    own chat_template_kwargs win); Claude Code's x-anthropic-billing-header system block is client
    metadata, left out of the prompt; text blocks stand on lines of their own."""
    from eagle_infer.anthropic_api import MessagesRequest

    def chat(**kw):
        hi = [{"role": "user", "content": "Hi"}]
        return MessagesRequest(max_tokens=5, messages=hi, **kw).chat_request()

    assert chat(thinking={"type": "disabled"}).chat_template_kwargs == {"enable_thinking": False}
    assert chat(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True}
                ).chat_template_kwargs == {"enable_thinking": True}
    assert chat(thinking={"type": "enabled", "budget_tokens": 2048}).chat_template_kwargs is None
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli"},
              {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    assert chat(system=system).messages[0].content == "Be brief.\nBe kind."
