"""The ``anthropic`` SDK against the appliance (run in its own venv by
test_real_clients.py; it sends the key as ``x-api-key``): a message whole and
streamed, and ``count_tokens``. Prints one JSON object of what the client got."""

import json
import os

import anthropic

MODEL = os.environ["APPLIANCE_MODEL"]
client = anthropic.Anthropic(
    base_url=os.environ["APPLIANCE_URL"],
    api_key=os.environ["APPLIANCE_KEY"],
    max_retries=0,
    timeout=300,
)
ask = [{"role": "user", "content": "Say hello."}]
whole = client.messages.create(model=MODEL, max_tokens=24, messages=ask)
with client.messages.stream(
    model=MODEL, max_tokens=24, system="Answer briefly.", messages=ask
) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
counted = client.messages.count_tokens(model=MODEL, messages=ask)
print(
    json.dumps(
        {
            "whole": "".join(b.text for b in whole.content if b.type == "text"),
            "whole_stop": whole.stop_reason,
            "streamed": streamed,
            "streamed_stop": final.stop_reason,
            "count_tokens": counted.input_tokens,
            "whole_input_tokens": whole.usage.input_tokens,
        }
    )
)
