"""APIs of the server are translations between typed results, never clients of each other's bytes.

A module in ``runtime/entrypoints/`` builds on another endpoint through its serving layer's typed
result (e.g. ``OpenAIServingChat.chat``: a response model or a stream of chunk models), never by
parsing what that endpoint writes on the wire. Read with ``ast``, every module there must not:

* read an HTTP response's bytes: ``.body_iterator`` anywhere, or a JSON decode (``json.loads`` /
  ``json.load`` / ``orjson.loads`` / ``model_validate_json`` / ``validate_json``) of an expression
  that reads a ``.body`` / ``.content`` attribute (a response's body). The *client's* request body
  (``await request.body()``, a called method, bound to a name first) may be parsed;
* handle SSE ``data:`` / ``event:`` lines outside ``streaming.py``, the server's one SSE writer;
* call an HTTP handler (a function taking a ``Request`` and returning a ``Response``) from anywhere
  but a route function (one decorated ``@router.post(...)`` and the like).

The checker is tested on the patterns it exists to catch (they were in the tree before issue 44)
and on what it must let through.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINTS = ROOT / "runtime" / "entrypoints"
SSE_WRITER = "streaming.py"
_DECODERS = {"loads", "load", "model_validate_json", "validate_json"}
_RESPONSE_BYTES = {"body", "content"}
_ROUTE_DECORATORS = {"get", "post", "put", "patch", "delete", "api_route", "route", "websocket"}
_HTTP_ANSWERS = {"Response", "StreamingResponse", "JSONResponse"}


def _is_route(fn: ast.AST) -> bool:
    return any(isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in _ROUTE_DECORATORS
               for d in getattr(fn, "decorator_list", []))


def _reads_response_bytes(expr: ast.AST) -> bool:
    """Whether ``expr`` reads an attribute that holds a response's bytes (not a called method)."""
    called = {id(n.func) for n in ast.walk(expr) if isinstance(n, ast.Call)}
    return any(isinstance(n, ast.Attribute) and n.attr in _RESPONSE_BYTES and id(n) not in called
               for n in ast.walk(expr))


def _annotation_names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def http_handlers(sources: dict[str, str]) -> set[str]:
    """Names of the functions that take a ``Request`` and answer a ``Response`` (HTTP handlers)."""
    names = set()
    for src in sources.values():
        for fn in ast.walk(ast.parse(src)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_route(fn):
                takes = set().union(*(_annotation_names(a.annotation) for a in fn.args.args))
                if "Request" in takes and _annotation_names(fn.returns) & _HTTP_ANSWERS:
                    names.add(fn.name)
    return names


def findings(sources: dict[str, str]) -> list[str]:
    """Every place where a module of ``sources`` ({file name: source}) parses another endpoint's
    bytes or calls another endpoint's HTTP handler (see the module doc)."""
    handlers = http_handlers(sources)
    out = []
    for name, src in sorted(sources.items()):
        tree = ast.parse(src)
        routes = [fn for fn in ast.walk(tree) if _is_route(fn)]
        in_route = {id(n) for fn in routes for n in ast.walk(fn)}
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr == "body_iterator":
                out.append(f"{where}: reads a response's body_iterator")
            elif isinstance(node, ast.Call):
                func = node.func
                attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if attr in _DECODERS and any(_reads_response_bytes(a) for a in node.args):
                    out.append(f"{where}: decodes a response's body")
                elif attr in handlers and isinstance(func, ast.Attribute) and id(node) not in in_route:
                    out.append(f"{where}: calls the HTTP handler {attr}() outside a route")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and name.split("/")[-1] != SSE_WRITER
                  and node.value.lstrip().startswith(("data:", "event:"))):
                out.append(f"{where}: handles SSE lines ({node.value[:12]!r}) outside {SSE_WRITER}")
    return sorted(set(out), key=lambda f: (f.split(":")[0], int(f.split(":")[1]), f))


def _tree_sources() -> dict[str, str]:
    return {str(p.relative_to(ENTRYPOINTS)): p.read_text() for p in sorted(ENTRYPOINTS.rglob("*.py"))}


def test_no_entrypoint_parses_another_endpoints_bytes():
    assert findings(_tree_sources()) == []


def test_the_checker_finds_what_the_tree_had_before_issue_44():
    # The Responses and Messages layers as they were: clients of the chat endpoint's bytes.
    old = textwrap.dedent('''
        import json
        from fastapi import Request
        from fastapi.responses import Response, StreamingResponse

        class OpenAIServingChat:
            async def create_chat_completion(self, body, http_request: Request) -> Response: ...

        async def create(chat, body, http_request: Request) -> Response:
            chat_response = await chat.create_chat_completion(body, http_request)
            choice = json.loads(chat_response.body)["choices"][0]
            events = _events(chat_response.body_iterator)

        async def _events(chunks):
            async for raw in chunks:
                for line in raw.decode().splitlines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])

        def sse(kind, data):
            return f"event: {kind}\\ndata: {json.dumps(data)}\\n\\n"
    ''')
    found = findings({"serving_responses.py": old})
    assert [f.split(": ", 1)[1] for f in found] == [
        "calls the HTTP handler create_chat_completion() outside a route",
        "decodes a response's body",
        "reads a response's body_iterator",
        "handles SSE lines ('data: ') outside streaming.py",
        "handles SSE lines ('data: [DONE]') outside streaming.py",
        "handles SSE lines ('\\ndata: ') outside streaming.py",
        "handles SSE lines ('event: ') outside streaming.py",
    ], found


def test_the_checker_lets_the_clients_body_and_the_sse_writer_through():
    client_body = textwrap.dedent('''
        import json
        from fastapi import APIRouter, Request
        from fastapi.responses import Response
        router = APIRouter()

        async def parse_body(request: Request, model):
            raw = await request.body()
            try:
                return model.model_validate_json(raw)
            except ValueError:
                return json.loads(raw)

        def arguments(call):
            return json.loads(call["function"]["arguments"])  # the model's tool call, not a response

        class Serving:
            async def create(self, body, http_request: Request) -> Response: ...

        @router.post("/v1/x")
        async def route(request: Request):
            return await request.app.state.serving.create(await parse_body(request, dict), request)
    ''')
    writer = 'SSE_DONE = "data: [DONE]\\n\\n"\ndef sse(c):\n    return f"data: {c}\\n\\n"\n'
    assert findings({"request_body.py": client_body, "openai/streaming.py": writer}) == []
