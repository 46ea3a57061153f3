"""The OpenAI Agents SDK against a running server: its default model speaks the Responses API
(/v1/responses), so an agent run is a check of that route as a real client uses it.

    python -m venv /tmp/agents && /tmp/agents/bin/pip install openai-agents
    python -m eagle_infer.server --tool-call-parser hermes --enable-auto-tool-choice \\
        --chat-template conf/chat_templates/smollm2_tools.jinja &
    /tmp/agents/bin/python scripts/probe_agents_sdk.py --url http://localhost:30000/v1

Runs an agent without tools, one whose tool_choice "required" must call a function tool, and a
streamed run with the tool on "auto"; prints each final output, and fails (status 1) where a
request fails or the forced call did not run the tool. The SDK is not a dependency of this
project: it lives in its own environment.
"""

from __future__ import annotations

import argparse
import asyncio
import sys


async def probe(url: str, model_name: str | None) -> bool:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://localhost:30000/v1")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    args = ap.parse_args()
    ok = asyncio.run(probe(args.url, args.model))
    if not ok:
        print("the forced tool call did not run the tool", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
