"""The official ``openai`` SDK against the appliance (run in its own venv by
test_real_clients.py): Responses whole, streamed and continued with
``previous_response_id``, and a chat completion with a JSON-schema ``response_format``.
Prints one JSON object of what the client got."""

import json
import os

from openai import OpenAI

MODEL = os.environ["APPLIANCE_MODEL"]
SCHEMA = json.loads(os.environ["APPLIANCE_SCHEMA"])
client = OpenAI(
    base_url=os.environ["APPLIANCE_URL"] + "/v1",
    api_key=os.environ["APPLIANCE_KEY"],
    max_retries=0,
    timeout=300,
)

first = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=24)
again = client.responses.create(
    model=MODEL,
    input="Say it once more.",
    previous_response_id=first.id,
    max_output_tokens=24,
)
deltas, done = [], None
for event in client.responses.create(
    model=MODEL, input="Name a colour.", max_output_tokens=24, stream=True
):
    if event.type == "response.output_text.delta":
        deltas.append(event.delta)
    elif event.type == "response.completed":
        done = event.response
chat = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Describe a cat as JSON with a name and an age."}],
    response_format={
        "type": "json_schema",
        "json_schema": {"name": "cat", "schema": SCHEMA, "strict": True},
    },
    max_tokens=64,
    temperature=0,
)
print(
    json.dumps(
        {
            "first": first.output_text,
            "first_status": first.status,
            "again": again.output_text,
            "again_previous": again.previous_response_id,
            "again_input_tokens": again.usage.input_tokens if again.usage else 0,
            "first_input_tokens": first.usage.input_tokens if first.usage else 0,
            "streamed": "".join(deltas),
            "streamed_status": done.status if done else None,
            "chat_json": chat.choices[0].message.content,
        }
    )
)
