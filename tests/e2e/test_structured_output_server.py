"""Structured outputs, tool calling, token controls and /tokenize against a real ``kvfleet serve``
(the default model, a tiny KV cache so that concurrent requests are preempted) with the official
``openai`` client: every constrained output validates against its schema, also sampled (n=3,
seeded), streamed (equal to non-streamed), preempted and beside unconstrained requests; tools
with each ``tool_choice``; logit_bias ±100; tokenize round trips; bad specs are 400s."""

from __future__ import annotations

import asyncio
import enum
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from support.serve import start_serve, stop_serve

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("so") / "server.log"
    # 32 blocks of 16 tokens: twelve concurrent requests outgrow it (preemption by recompute).
    proc, base = start_serve(["--dtype", "float32", "--num-blocks", "32", "--log-level", "warning",
                              "--tool-call-parser", "hermes", "--enable-auto-tool-choice"], log)  # fmt: skip
    yield base
    stop_serve(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Role(enum.StrEnum):
    admin = "admin"
    user = "user"


class Home(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    """Nested object, array with min/maxItems, enum, patterns, bounded integer (short keys: short outputs)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(pattern=r"^[A-Z][a-z]{1,7}$")
    age: int = pydantic.Field(ge=18, le=99)
    role: Role
    pets: list[pydantic.constr(max_length=5)] = pydantic.Field(min_length=1, max_length=2)  # type: ignore[valid-type]
    home: Home


SCHEMA = Person.model_json_schema()
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]


def preemptions(server) -> float:
    text = httpx.get(server + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^kvfleet:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M))


def test_parse_pydantic_greedy_stream_equals_non_stream_and_n3_seeded(server):
    async def run():
        c = aclient(server)
        kw = dict(model=MODEL, messages=user("Describe a user of our site."), max_tokens=100)
        parsed = c.chat.completions.parse(**kw, response_format=Person, temperature=0)

        async def streamed() -> str:
            stream = await c.chat.completions.create(**kw, response_format=JSON_SCHEMA_FORMAT, temperature=0,
                                                     stream=True)  # fmt: skip
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

        # n=3 with seed 11: the sequences have seeds 11, 12, 13 (the first equals a lone seed-11 request)
        sampled = [c.chat.completions.create(**kw, response_format=JSON_SCHEMA_FORMAT, temperature=0.8, n=3, seed=11),
                   c.chat.completions.create(**kw, response_format=JSON_SCHEMA_FORMAT, temperature=0.8, seed=11)]
        return await asyncio.gather(parsed, streamed(), *sampled)

    r, streamed, s1, s2 = asyncio.run(run())
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
    assert streamed == choice.message.content
    texts = [c.message.content for c in s1.choices]
    assert texts[0] == s2.choices[0].message.content and len(set(texts)) > 1  # seeded, and sampled
    for c in s1.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        Person.model_validate_json(c.message.content)


def test_12_concurrent_mixed_requests_all_valid_with_preemption(server):
    before = preemptions(server)

    async def run():
        c = aclient(server)
        chats = [c.chat.completions.create(model=MODEL, messages=user(f"Person number {i}, please."),
                                           response_format=JSON_SCHEMA_FORMAT, max_tokens=100, temperature=0.7,
                                           seed=i) for i in range(4)]  # fmt: skip
        objects = [c.chat.completions.create(model=MODEL, messages=user("Give me a JSON object about cats."),
                                             response_format={"type": "json_object"}, max_tokens=60,
                                             temperature=0) for _ in range(2)]  # fmt: skip
        choices = [c.completions.create(model=MODEL, prompt=f"Q{i}: is the sky blue? A:", max_tokens=8,
                                        extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
                   for i in range(2)]  # fmt: skip
        regexes = [c.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                        extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"}) for _ in range(2)]
        plain = [c.chat.completions.create(model=MODEL, messages=user("Tell me a long story."), max_tokens=80,
                                           temperature=0, extra_body={"ignore_eos": True}) for _ in range(2)]
        return await asyncio.gather(*chats, *objects, *choices, *regexes, *plain)

    out = asyncio.run(run())
    for r in out[:4]:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    for r in out[4:6]:  # JSON mode ends: an object, or cut by max_tokens (finish_reason length)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert (reason == "stop" and isinstance(json.loads(text), dict)) or (reason == "length" and
                                                                             text.startswith("{"))  # fmt: skip
    for r in out[6:8]:
        assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop"
    for r in out[8:10]:
        assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    for r in out[10:]:
        assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    assert preemptions(server) > before, "no request was preempted: the test did not test that"


def test_tool_choices_streamed_deltas_and_a_tool_result_round_trip(server, client):
    msgs = user("What is the weather in Paris?")
    kw = dict(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=60, temperature=0)
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    get_time = {"type": "function", "function": {"name": "get_time"}}

    async def run():
        c = aclient(server)

        async def streamed():
            stream = await c.chat.completions.create(**kw, tool_choice=get_time, stream=True)
            return [ch async for ch in stream]

        return await asyncio.gather(
            c.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False),
            c.chat.completions.create(**kw, tool_choice=get_time), streamed(),
            c.chat.completions.create(**{**kw, "max_tokens": 8}, tool_choice="none"),
            # auto: the server parses what the model writes, forced here into the hermes format and
            # into plain text (the small model does not pick tools by itself).
            c.chat.completions.create(**kw, extra_body={"structured_outputs": {"choice": [hermes]}}),
            c.chat.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["Sunny, 21 C."]}}))

    req, named, chunks, none, forced, plain = asyncio.run(run())
    for r, name in ((req, None), (named, "get_time")):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id and (name is None or call.function.name == name)
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    # Streamed: the name once, then argument fragments that add up to the non-streamed arguments.
    names, args, finish = [], "", None
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            assert d.index == 0
            if d.function.name:
                names.append(d.function.name)
            args += d.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert names == ["get_time"] and finish == "tool_calls"
    assert args == named.choices[0].message.tool_calls[0].function.arguments

    assert none.choices[0].message.tool_calls in (None, []) and none.choices[0].message.content
    call = forced.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris",
                                                                                         "unit": "celsius"})
    assert forced.choices[0].finish_reason == "tool_calls" and forced.choices[0].message.content is None
    assert plain.choices[0].message.content == "Sunny, 21 C." and not plain.choices[0].message.tool_calls

    # The tool result goes back; the rendered prompt is what /tokenize counts.
    assistant = req.choices[0].message
    follow = msgs + [assistant.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": assistant.tool_calls[0].id, "content": '{"temp_c": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)  # fmt: skip
    assert answer.choices[0].message.content
    count = httpx.post(server + "/tokenize", json={"messages": follow, "tools": TOOLS}).json()["count"]
    assert count == answer.usage.prompt_tokens


def test_logit_bias_bad_words_allowed_token_ids_and_tokenize(server, client):
    prompt = "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    toks = httpx.post(server + "/tokenize", json={"prompt": base.choices[0].text, "return_token_strs": True}).json()
    first = toks["tokens"][0]
    assert toks["count"] == len(toks["tokens"]) == len(toks["token_strs"]) and toks["max_model_len"] == 512
    assert httpx.post(server + "/detokenize", json={"tokens": toks["tokens"]}).json() == {
        "prompt": base.choices[0].text}
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100})  # fmt: skip
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.9, seed=1,
                                       logit_bias={"42": 100})  # fmt: skip
    assert httpx.post(server + "/tokenize", json={"prompt": banned.choices[0].text}).json()["tokens"][0] != first
    assert httpx.post(server + "/detokenize", json={"tokens": [42] * 4}).json()["prompt"] == forced.choices[0].text
    allowed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                        extra_body={"allowed_token_ids": [42, 43]})  # fmt: skip
    assert set(httpx.post(server + "/tokenize", json={"prompt": allowed.choices[0].text}).json()["tokens"]) <= {42, 43}
    word = base.choices[0].text.split()[0]
    no_word = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"bad_words": [word]})  # fmt: skip
    assert word not in no_word.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=1)
    assert httpx.post(server + "/tokenize", json={"messages": user("hi")}).json()["count"] == chat.usage.prompt_tokens


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format",
     'Unsupported type "strin"'),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format", "minimum greater than maximum"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs",
     'Rule "nothing" is not defined'),
    ("/v1/completions", {"guided_json": {"type": "strin"}}, "guided_json", "invalid JSON schema"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "strin"}}}], "tool_choice": "required"}, "tools", "invalid structural tag"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ("/v1/completions", {"logit_bias": {"1": 1000}}, "logit_bias", "[-100, 100]"),
]


def test_bad_specs_are_400_naming_the_field(server, client):
    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=120) as http:
            bodies = [{"messages": user("hi")} if path.endswith("chat/completions") else {"prompt": "hi"}
                      for path, *_ in BAD]  # fmt: skip
            return await asyncio.gather(*[http.post(path, json={**b, **extra, "max_tokens": 4})
                                          for b, (path, extra, *_) in zip(bodies, BAD)])  # fmt: skip

    for r, (_, _, param, message) in zip(asyncio.run(run()), BAD):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and message in err["message"], err
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
