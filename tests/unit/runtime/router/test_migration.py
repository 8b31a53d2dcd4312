"""MigratingStream over scripted upstreams: the client sees one stream across replicas (first
``id``/``created``, the role chunk once, router-only fields stripped, usage counted once), the
resumed body carries the committed token ids (held ones excluded), and a stream that cannot
migrate ends with a ``migration_failed`` error event and ``[DONE]``."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvfleet.runtime.router.migration import MigratingStream, why_not_migratable


class Upstream:
    """A replica's SSE body: ``events`` (dicts or ``"[DONE]"``), then ``fail`` (an exception) or the end."""

    def __init__(self, events, fail: Exception | None = None):
        self.events, self.fail, self.closed = events, fail, False

    async def aiter_text(self):
        for e in self.events:
            yield f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n"
        if self.fail is not None:
            raise self.fail

    async def aclose(self):
        self.closed = True


def chunk(cid, created, idx, content=None, ids=None, role=None, finish=None, usage=None):
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    choice = {"index": idx, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["kvfleet_token_ids"] = ids
    return {"id": cid, "created": created, "object": "chat.completion.chunk", "choices": choice and [choice],
            "usage": usage}


def run(body, upstreams, max_migrations=3):
    sent, moved = [], []

    async def reopen(b, reason):
        sent.append(b)
        return upstreams.pop(0) if upstreams else "no replica"

    async def go():
        stream = run.stream = MigratingStream(body, upstreams.pop(0), reopen, max_migrations,
                                              lambda r, t: moved.append((r, t)))
        return [e async for e in stream.events()]

    events = asyncio.run(go())
    return [e.decode()[6:].strip() for e in events], sent, moved


BODY = {"model": "m", "stream": True, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def test_a_broken_stream_continues_on_another_replica_as_one_stream():
    first = Upstream([chunk("a", 1, 0, "", role="assistant"), chunk("a", 1, 0, "He", ids=[5, 6]),
                      {"id": "a", "object": "kvfleet.token_ids", "choices": [{"index": 0, "kvfleet_token_ids": [7]}]}],
                     fail=httpx.RemoteProtocolError("peer closed"))
    second = Upstream([chunk("b", 2, 0, "", role="assistant"), chunk("b", 2, 0, "llo", ids=[7, 8]),
                       chunk("b", 2, 0, finish="length"),
                       {"id": "b", "created": 2, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                                          "total_tokens": 5}}, "[DONE]"])
    out, sent, moved = run(BODY, [first, second])
    assert sent[0]["kvfleet_resume"] == {"output_token_ids": [[5, 6]]}  # the held 7 is not committed
    assert moved == [("upstream_error", 2)]
    assert out[-1] == "[DONE]"
    chunks = [json.loads(e) for e in out[:-1]]
    assert {(c["id"], c["created"]) for c in chunks} == {("a", 1)}
    assert [c["choices"][0]["delta"] for c in chunks if c["choices"]] == [
        {"role": "assistant", "content": ""}, {"content": "He"}, {"content": "llo"}, {}]
    assert not any(k.startswith("kvfleet") for c in chunks for ch in c["choices"] for k in ch)
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert run.stream.failed is None  # its outcome stays success; a failed one is migration_failed


def test_a_stream_migrates_twice_with_every_delivered_token():
    """The resumed request asks for token ids too (the client's body may not): the second replica's
    tokens count as delivered for a second migration, and its drain can hand the stream off."""
    drain = {"error": {"message": "draining", "type": "server_error", "code": "kvfleet_resume_elsewhere"}}
    first = Upstream([chunk("a", 1, 0, "He", ids=[5, 6]), drain])
    second = Upstream([chunk("b", 2, 0, "ll", ids=[7, 8]), drain])
    third = Upstream([chunk("c", 3, 0, "o", ids=[9], finish="length"), "[DONE]"])
    out, sent, moved = run(BODY, [first, second, third])
    assert [b["kvfleet_token_ids"] for b in sent] == [True, True]
    assert [b["kvfleet_resume"] for b in sent] == [{"output_token_ids": [[5, 6]]}, {"output_token_ids": [[5, 6, 7, 8]]}]
    assert moved == [("drain", 2), ("drain", 4)]
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in out[:-1]) == "Hello"


def test_the_drain_signal_migrates_and_a_stream_that_cannot_ends_with_an_error_event():
    drain = {"error": {"message": "draining", "type": "server_error", "code": "kvfleet_resume_elsewhere"}}
    out, sent, moved = run(BODY, [Upstream([chunk("a", 1, 0, "x", ids=[1]), drain])], max_migrations=0)
    assert sent == [] and moved == [] and run.stream.failed
    assert json.loads(out[-2])["error"]["code"] == "migration_failed" and out[-1] == "[DONE]"
    out, sent, moved = run(BODY, [Upstream([chunk("a", 1, 0, "x", ids=[1]), drain])])
    assert "could not migrate: no replica" in json.loads(out[-2])["error"]["message"]
    assert why_not_migratable({**BODY, "tools": [{"type": "function"}]})
    assert why_not_migratable(BODY) is None


def test_a_stream_that_could_not_migrate_is_counted_as_migration_failed():
    """router_requests_total's outcome: a migratable stream that ended with the error event passed
    through whole (status 200) but is not a success."""
    from kvfleet.runtime.router.proxy import MigratingResponse

    class Forwarder:
        max_migrations = 1

        def __init__(self):
            self.outcomes = []

        def _done(self, ep, outcome):
            self.outcomes.append(outcome)

        def migrated(self, reason, tokens):
            pass

    class Ep:
        url = "http://replica"

    first = httpx.Response(200, headers={"content-type": "text/event-stream"})
    fwd = Forwarder()
    resp = MigratingResponse(first, Ep(), fwd, dict(BODY), "/v1/chat/completions", {})
    resp._finish(Ep(), "success")
    resp.stream.failed = "could not migrate: no replica"
    resp._finish(Ep(), "success")
    resp._finish(Ep(), "client_disconnect")
    assert fwd.outcomes == ["success", "migration_failed", "client_disconnect"]
