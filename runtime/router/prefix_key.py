"""The prefix key of a request: what :mod:`.picker` hashes for prefix affinity.

A replica's prefix cache matches whole KV blocks of *tokens* (hash chain over full blocks of
``block_size`` token ids, after the chat template). The router does not tokenize: loading the
model's tokenizer would make a pure proxy import transformers and spend time per request that
the < 2 ms budget of the router does not have. It hashes the first ``prefix_chars`` *characters*
of the text the replica will tokenize instead, a stand-in that is exact in the direction that
matters: a BPE/SentencePiece tokenizer is deterministic and local (a token spans a few
characters), and a chat template is a fixed function of the messages in order, so two prompts
whose first C characters agree tokenize to the same leading tokens (all but possibly the last
one before the divergence), hence share the same leading full blocks. With about 4 characters per
token, the default 256 characters cover ~64 tokens, 4 blocks of 16: requests that share a system
prompt (or the first turns of a conversation) longer than that get the same key; prompts that
agree on fewer characters share at most a few blocks, so losing their affinity costs little.

Key layout: ``model + "\\0" + the first prefix_chars characters`` (chat and Anthropic's
``/v1/messages``, its ``system`` first: ``role\\ncontent\\n`` for each message in order, text
parts of multi-part contents joined; completions: the prompt, or the
first prompt of a batch; token-id prompts: their first ``prefix_chars // 4`` ids as decimals).
"""

from __future__ import annotations

from typing import Any

DEFAULT_PREFIX_CHARS = 256


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multi-part content: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _prompt_text(prompt: Any, prefix_chars: int) -> str | None:
    if isinstance(prompt, str):
        return prompt[:prefix_chars]
    if isinstance(prompt, list) and prompt:
        head = prompt[0]
        if isinstance(head, int):
            return ",".join(str(t) for t in prompt[: max(1, prefix_chars // 4)] if isinstance(t, int))
        return _prompt_text(head, prefix_chars)
    return None


def prefix_key(path: str, body: Any, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str | None:
    """The prefix key of a parsed JSON request ``body`` sent to ``path`` (``/v1/...``), or None
    when the request carries no prompt (``/v1/models``, a body that is not an object, an empty
    prompt): such requests are routed by least load.

    ``prefix_chars`` (>= 1): characters of the prompt text the key covers.
    """
    if not isinstance(body, dict):
        return None
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    text: str | None = None
    if path.endswith(("/chat/completions", "/v1/messages")):
        messages = body.get("messages")
        if path.endswith("/v1/messages") and body.get("system") and isinstance(messages, list):
            messages = [{"role": "system", "content": body["system"]}, *messages]  # Anthropic's system prompt
        if isinstance(messages, list):
            parts: list[str] = []
            size = 0
            for m in messages:
                if not isinstance(m, dict):
                    continue
                piece = f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n"
                parts.append(piece)
                size += len(piece)
                if size >= prefix_chars:
                    break
            text = "".join(parts)[:prefix_chars]
    elif path.endswith("/responses"):  # Responses API: instructions, then the input (string or items)
        inp = body.get("input")
        items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp if isinstance(inp, list) else []
        head = f"system\n{body['instructions']}\n" if isinstance(body.get("instructions"), str) else ""
        text = (head + "".join(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n"
                               for m in items if isinstance(m, dict)))[:prefix_chars]
    elif "prompt" in body:
        text = _prompt_text(body["prompt"], prefix_chars)
    if not text:
        return None
    return f"{model}\0{text}"
