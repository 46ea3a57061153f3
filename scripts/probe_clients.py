"""Client libraries against a running server, as their users call it: the OpenAI Agents SDK
(whose default model speaks the Responses API, /v1/responses), LangChain's ChatOpenAI (chat
completions, and the Responses API with use_responses_api) and Anthropic's SDK (/v1/messages).

    python -m venv /tmp/clients && /tmp/clients/bin/pip install openai-agents langchain-openai anthropic
    python -m eagle_infer.server --tool-call-parser hermes --enable-auto-tool-choice \\
        --chat-template conf/chat_templates/smollm2_tools.jinja &
    /tmp/clients/bin/python scripts/probe_clients.py --url http://localhost:30000/v1

Agents SDK: an agent without tools, one whose tool_choice "required" must call a function tool,
and a streamed run with the tool on "auto". LangChain: invoke and stream, bind_tools with a named
tool, with_structured_output by json_schema, function_calling and json_mode, and invoke and
stream through the Responses API. Anthropic: a message and its stream, a forced tool_use
(tool_choice any), the tool's result sent back, a named tool streamed, count_tokens. Prints each
output; fails (status 1) where a request fails, a forced call did not run or end in tool_use, or a
schema-bound structured output does not parse (json_mode asks only for JSON: whether the model
keeps the fields is the model's). The libraries are not dependencies of this project: they live
in their own environment.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


async def probe_agents(url: str, model_name: str | None) -> bool:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url, api_key="none")
    name = model_name or (await client.models.list()).data[0].id
    model = OpenAIResponsesModel(model=name, openai_client=client)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny, 21 C in {city}"

    settings = ModelSettings(max_tokens=64, temperature=0)
    plain = await Runner.run(Agent(name="plain", instructions="Answer briefly.", model=model,
                                   model_settings=settings), "What is the capital of France?")
    print(f"no tools: {plain.final_output!r}")
    forced = Agent(name="forced", instructions="Use the tool.", model=model, tools=[get_weather],
                   model_settings=ModelSettings(max_tokens=64, temperature=0, tool_choice="required"),
                   tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(forced, "What is the weather in Paris?")
    print(f"tool_choice required: the tool ran with {calls}, output {result.final_output!r}")
    streamed = Runner.run_streamed(Agent(name="auto", instructions="Use the tool.", model=model,
                                         tools=[get_weather], model_settings=settings),
                                   "What is the weather in Paris? Call get_weather.")
    kinds: dict[str, int] = {}
    async for event in streamed.stream_events():
        kinds[event.type] = kinds.get(event.type, 0) + 1
    print(f"streamed, tool_choice auto: {streamed.final_output!r} (events {kinds})")
    return bool(calls)


def probe_langchain(url: str, model_name: str | None) -> bool:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from openai import OpenAI
    from pydantic import BaseModel

    name = model_name or OpenAI(base_url=url, api_key="none").models.list().data[0].id
    llm = ChatOpenAI(base_url=url, api_key="none", model=name, temperature=0, max_tokens=48)
    print(f"invoke: {llm.invoke('What is the capital of France?').content!r}")
    print(f"stream: {''.join(str(c.content) for c in llm.stream('Count to three.'))!r}")

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    calls = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?").tool_calls
    print(f"bind_tools, a named tool: {calls}")

    class City(BaseModel):
        name: str
        country: str

    parsed = []
    for method in ("json_schema", "function_calling", "json_mode"):
        ask = "Name a city in France as JSON with name and country."
        try:
            out = llm.with_structured_output(City, method=method).invoke(ask)
        except Exception as e:  # json_mode asks for any JSON: the schema's fields are the model's to keep
            out = f"{type(e).__name__}: {str(e)[:120]}"
        print(f"with_structured_output({method}): {out!r}")
        parsed.append(isinstance(out, City) or method == "json_mode")
    responses = ChatOpenAI(base_url=url, api_key="none", model=name, temperature=0, max_tokens=48,
                           use_responses_api=True)
    answer = responses.invoke("What is the capital of France?")
    print(f"Responses API: {answer.text!r}, usage {answer.usage_metadata}")
    print(f"Responses API, streamed: {''.join(c.text for c in responses.stream('Count to three.'))!r}")
    return bool(calls) and all(parsed) and bool(answer.text)


def probe_anthropic(url: str, model_name: str | None) -> bool:
    import anthropic
    from openai import OpenAI

    name = model_name or OpenAI(base_url=url, api_key="none").models.list().data[0].id
    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="none")
    greedy = {"extra_body": {"temperature": 0}}  # the SDK has no temperature argument now
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    msg = client.messages.create(model=name, max_tokens=40, system="Be brief.", messages=ask, **greedy)
    print(f"Anthropic messages: {msg.content}, {msg.stop_reason}, {msg.usage.input_tokens} + "
          f"{msg.usage.output_tokens} tokens")
    with client.messages.stream(model=name, max_tokens=40, messages=ask, **greedy) as stream:
        text = "".join(stream.text_stream)
    print(f"Anthropic messages, streamed: {text!r}")
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(model=name, max_tokens=64, tools=tools, tool_choice={"type": "any"},
                                    messages=weather, **greedy)
    uses = [b for b in called.content if b.type == "tool_use"]
    print(f"tool_choice any: {[(b.name, b.input) for b in uses]}, {called.stop_reason}")
    if not uses:
        return False
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}
    after = client.messages.create(model=name, max_tokens=40, tools=tools, messages=[
        *weather, {"role": "assistant", "content": called.content}, {"role": "user", "content": [result]}],
        **greedy)
    print(f"after the tool's result: {after.content}")
    with client.messages.stream(model=name, max_tokens=64, tools=tools, messages=weather,
                                tool_choice={"type": "tool", "name": "get_weather"}, **greedy) as stream:
        final = stream.get_final_message()
    print(f"a named tool, streamed: {[(b.type, getattr(b, 'input', None)) for b in final.content]}, "
          f"{final.stop_reason}")
    counted = client.messages.count_tokens(model=name, messages=ask)
    print(f"count_tokens: {counted.input_tokens}")
    return bool(msg.content) and called.stop_reason == final.stop_reason == "tool_use"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://localhost:30000/v1")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    args = ap.parse_args()
    agents = asyncio.run(probe_agents(args.url, args.model))
    if not agents:
        print("Agents SDK: the forced tool call did not run the tool", file=sys.stderr)
    langchain = probe_langchain(args.url, args.model)
    if not langchain:
        print("LangChain: a named tool call, a structured output or a Responses answer is missing",
              file=sys.stderr)
    claude = probe_anthropic(args.url, args.model)
    if not claude:
        print("Anthropic SDK: an answer, a forced tool_use or its stop_reason is missing", file=sys.stderr)
    sys.exit(0 if agents and langchain and claude else 1)


if __name__ == "__main__":
    main()
