"""The character-level prefix key of a request (kvfleet.runtime.router.prefix_key)."""

from __future__ import annotations

from kvfleet.runtime.router.prefix_key import prefix_key


def test_prefix_key_chat_completions_and_token_ids():
    sys_prompt = "You are a helpful assistant. " * 20
    a = prefix_key("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": sys_prompt}, {"role": "user", "content": "one"}]})
    b = prefix_key("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": [{"type": "text", "text": sys_prompt}]}, {"role": "user", "content": "two"}]})
    assert a == b and len(a) == len("m\0") + 256
    c = prefix_key("/v1/chat/completions", {"model": "other", "messages": [{"role": "system", "content": sys_prompt}]})
    assert c != a  # another model, another cache
    assert prefix_key("/v1/completions", {"model": "m", "prompt": "hello"}) == "m\0hello"
    assert prefix_key("/v1/completions", {"prompt": ["first", "second"]}) == "\0first"
    assert prefix_key("/v1/completions", {"prompt": list(range(100))}, prefix_chars=16) == "\x000,1,2,3"
    for body in (None, [], {"prompt": ""}, {"messages": "x"}, {}):
        assert prefix_key("/v1/chat/completions", body) is None
    assert prefix_key("/v1/models", {"model": "m"}) is None


def test_anthropic_messages_key_like_chat():
    """/v1/messages gets the chat key of the same conversation (its system prompt first), so a
    conversation keeps its replica whichever API it arrives by."""
    sys_prompt = "You are a helpful assistant. " * 10
    chat = prefix_key("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": sys_prompt}, {"role": "user", "content": "hi"}]})
    for system in (sys_prompt, [{"type": "text", "text": sys_prompt}]):
        anth = prefix_key("/v1/messages", {"model": "m", "max_tokens": 5, "system": system,
                                           "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
        assert anth == chat
    assert prefix_key("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]}) is not None


def test_responses_key_covers_instructions_and_input():
    a = prefix_key("/v1/responses", {"model": "m", "instructions": "be brief", "input": "hello"})
    b = prefix_key("/v1/responses", {"model": "m", "instructions": "be brief",
                                     "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]})
    assert a == b == "m\0system\nbe brief\nuser\nhello\n"
    assert prefix_key("/v1/embeddings", {"model": "m", "input": "x"}) is None
