"""``/v1/responses`` and ``/v1/embeddings`` end to end with the official ``openai`` SDK on one real server (SmolLM2-135M):
text, streaming events that add up to the final object, a function-tool round trip, structured
output through ``text.format``, stored responses (retrieve, delete, ``previous_response_id``) and
400s in OpenAI's shape for what is refused."""

from __future__ import annotations

import json

import openai
import pytest
from support.serve import start_serve, stop_serve

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "server.log"
    proc, base = start_serve(["--dtype", "float32", "--log-level", "warning", "--max-stored-responses", "2",
                              "--tool-call-parser", "hermes", "--enable-auto-tool-choice"], log)
    yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
    stop_serve(proc)


def test_text_and_usage(client):
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Say hello.", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens <= 8 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_stream_events_add_up(client):
    events = list(client.responses.create(model="SmolLM2-135M-Instruct", input="Count to five.",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert k in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    blocking = client.responses.create(model="SmolLM2-135M-Instruct", input="Count to five.",
                                       max_output_tokens=12, temperature=0)
    assert final.output_text == blocking.output_text and final.usage.output_tokens == blocking.usage.output_tokens


def test_function_tool_round_trip(client):
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="What is the weather in Paris?",
                                tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                temperature=0, max_output_tokens=40)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    events = list(client.responses.create(model="SmolLM2-135M-Instruct", input="What is the weather in Paris?",
                                          tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0, max_output_tokens=40, stream=True))
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    streamed = [o for o in events[-1].response.output if o.type == "function_call"]
    assert done == [streamed[0].arguments] == [calls[0].arguments]
    follow = client.responses.create(
        model="SmolLM2-135M-Instruct", tools=[WEATHER], temperature=0, max_output_tokens=20, tool_choice="none",
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}])
    assert follow.output[0].type == "message" and follow.output_text
    assert follow.usage.input_tokens > r.usage.input_tokens  # the tool result reached the prompt


def test_structured_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Invent a person.", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    data = json.loads(r.output_text)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int)


def test_store_retrieve_continue_delete(client):
    first = client.responses.create(model="SmolLM2-135M-Instruct", input="My name is Ada.", max_output_tokens=8)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = client.responses.create(model="SmolLM2-135M-Instruct", input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="SmolLM2-135M-Instruct", input="x", previous_response_id=first.id)
    unstored = client.responses.create(model="SmolLM2-135M-Instruct", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
])
def test_refused_is_400_naming_the_field(client, extra, param):
    kwargs = {"model": "SmolLM2-135M-Instruct", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kwargs)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- /v1/embeddings (same server)

PAIRS = [
    ("The cat sat on the mat.", "A cat was sitting on the rug."),
    ("How do I bake bread at home?", "What is a simple recipe for homemade bread?"),
    ("The stock market fell sharply today.", "Share prices dropped a lot today."),
]


def _cos(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_paraphrases_closer_than_unrelated(client):
    texts = [t for pair in PAIRS for t in pair]
    r = client.embeddings.create(model="SmolLM2-135M-Instruct", input=texts, encoding_format="float")
    vecs = [d.embedding for d in sorted(r.data, key=lambda d: d.index)]
    assert len(vecs) == 6 and abs(sum(x * x for x in vecs[0]) - 1) < 1e-4  # L2-normalised
    # Top-1 retrieval: each sentence is closer to its paraphrase than to every unrelated sentence.
    for i in range(3):
        para = _cos(vecs[2 * i], vecs[2 * i + 1])
        unrelated = [_cos(vecs[2 * i], vecs[k]) for k in range(6) if k // 2 != i]
        assert para > max(unrelated), (i, para, unrelated)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 6


def test_embeddings_alone_equals_batched_and_base64(client):
    import numpy as np

    batch = client.embeddings.create(model="SmolLM2-135M-Instruct", input=["Hello there.", PAIRS[1][0], "x y z"],
                                     encoding_format="float")
    alone = client.embeddings.create(model="SmolLM2-135M-Instruct", input=PAIRS[1][0], encoding_format="float")
    assert np.allclose(batch.data[1].embedding, alone.data[0].embedding, atol=1e-4)
    # The SDK's default asks for base64 and decodes it: the same float32 vector.
    b64 = client.embeddings.create(model="SmolLM2-135M-Instruct", input=PAIRS[1][0])
    assert np.allclose(b64.data[0].embedding, alone.data[0].embedding, atol=1e-6)
    tokens = client.embeddings.create(model="SmolLM2-135M-Instruct", input=[[504, 2634, 30]], encoding_format="float")
    assert len(tokens.data[0].embedding) == len(alone.data[0].embedding) and tokens.usage.prompt_tokens == 3


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"input": "hi", "dimensions": 7}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": [[10**9]]}, "input"),
])
def test_embeddings_bad_input_is_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="SmolLM2-135M-Instruct", encoding_format="float", **kwargs)
    assert info.value.body["param"] == param
