"""Runs the official `openai` client against a pdctl sim: chat and completions, whole
and streamed, and checks the answers. Usage: python openai_client_check.py BASE_URL"""
import sys

from openai import OpenAI

base = sys.argv[1]
client = OpenAI(base_url=base, api_key="unused")
passed = 0

models = client.models.list()
assert models.data[0].id == "sim-model", models
assert models.data[0].owned_by == "pdctl-sim", models

c = client.completions.create(model="sim-model", prompt="San Francisco is a", max_tokens=10)
assert c.choices[0].finish_reason == "length", c
assert c.usage.prompt_tokens == 4 and c.usage.completion_tokens == 10, c.usage
whole = c.choices[0].text
assert whole, c
passed += 1

text = ""
for chunk in client.completions.create(model="sim-model", prompt="San Francisco is a", max_tokens=10, stream=True):
    text += chunk.choices[0].text
assert text == whole, (text, whole)
passed += 1

msgs = [{"role": "user", "content": "Tell me about Roger Federer"}]
r = client.chat.completions.create(model="sim-model", messages=msgs, max_completion_tokens=8)
assert r.choices[0].message.role == "assistant", r
assert r.usage.completion_tokens == 8, r.usage
answer = r.choices[0].message.content
passed += 1

text, usage = "", None
stream = client.chat.completions.create(
    model="sim-model", messages=msgs, max_completion_tokens=8, stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for ch in chunk.choices:
        text += ch.delta.content or ""
assert text == answer, (text, answer)
assert usage is not None and usage.completion_tokens == 8, usage
passed += 1

print(f"openai client checks passed: {passed}")
