"""The ``openai-agents`` SDK running a one-tool agent against the appliance (run in its
own venv by test_real_clients.py), on the Responses API through our base URL; tracing
off (it would upload traces to OpenAI). Prints one JSON object of what the client got."""

import json
import os

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

set_tracing_disabled(True)
client = AsyncOpenAI(
    base_url=os.environ["APPLIANCE_URL"] + "/v1",
    api_key=os.environ["APPLIANCE_KEY"],
    max_retries=0,
    timeout=300,
)


@function_tool
def local_time(city: str) -> str:
    """The local time in a city."""
    return f"It is noon in {city}."


agent = Agent(
    name="clock",
    instructions="Answer in one short sentence. Use local_time for the time.",
    tools=[local_time],
    model=OpenAIResponsesModel(model=os.environ["APPLIANCE_MODEL"], openai_client=client),
    model_settings=ModelSettings(max_tokens=48),
)
result = Runner.run_sync(agent, "What time is it in Paris?", max_turns=3)
usage = result.context_wrapper.usage
print(
    json.dumps(
        {
            "final_output": str(result.final_output),
            "requests": usage.requests,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
        }
    )
)
