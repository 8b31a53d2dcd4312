"""Workloads of ``kvfleet bench``: lists of prompts with target output lengths.

Three datasets, with the meaning they have in vLLM's serving benchmark:

- ``random``: prompts of random token ids, ``input_len`` tokens each (uniform in
  ``[input_len * (1 - range_ratio), input_len * (1 + range_ratio)]``), decoded with the
  model's tokenizer and re-encoded until the text is exactly that many tokens; output
  lengths drawn the same way around ``output_len``.
- ``sharegpt``: the first human turn of each conversation as the prompt, the length of
  the first answer as the output length (vLLM's filters: prompt and output >= 4 tokens,
  prompt <= 1024, prompt + output <= 2048). From a local ShareGPT-format JSON file
  (``[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]``);
  without one, from a built-in *synthetic* conversation set (see
  :func:`synthetic_sharegpt_lengths`: not real ShareGPT text, only its heavy-tailed length
  shape).
- ``shared-prefix``: ``num_prompts`` requests that all start with the same system prompt
  of ``prefix_len`` tokens followed by ``input_len`` tokens of their own (prefix caching's
  best case: a chat product's fixed system prompt).

All lengths are tokens of the given tokenizer; everything is drawn from
``numpy.random.default_rng(seed)``, so the same seed gives the same workload.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

SYNTHETIC_SHAREGPT_PROMPT = (90.0, 1.0)
"""Built-in sharegpt set: prompt tokens ~ lognormal(median 90, sigma 1.0), clipped to [4, 1024]."""
SYNTHETIC_SHAREGPT_OUTPUT = (160.0, 0.9)
"""Built-in sharegpt set: output tokens ~ lognormal(median 160, sigma 0.9), clipped to
[4, 2048 - prompt]."""

_WORDS = (
    "the model server request token cache block batch memory latency throughput user answer "
    "question explain why how what when where write code python function list example about "
    "please summary story short long history science city river mountain music language data "
    "system design cluster node pod service deploy scale metric queue time first second value "
    "simple detail step describe compare difference between good better best small large fast"
).split()


@dataclass
class SampleRequest:
    """One request of a workload."""

    prompt: str
    """User text (for ``completions``: the whole prompt after ``system``)."""
    prompt_len: int
    """Prompt tokens by the benchmark's tokenizer (without a chat template), including ``system``."""
    expected_output_len: int
    """Output tokens to ask for (``max_tokens``)."""
    system: str | None = None
    """Shared system prompt (``shared-prefix``); chat: a system message, completions: prepended."""

    def completion_prompt(self) -> str:
        return (self.system or "") + self.prompt

    def chat_messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return messages + [{"role": "user", "content": self.prompt}]


def _allowed_token_ids(tokenizer) -> np.ndarray:
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    return np.array([i for i in range(vocab) if i not in special], dtype=np.int64)


def _text_of_exact_length(tokenizer, rng: np.random.Generator, allowed: np.ndarray, length: int) -> str:
    """Random token ids decoded to text that re-encodes to exactly ``length`` tokens
    (vLLM: decode, re-encode, fix up; a few rounds converge)."""
    ids = list(rng.choice(allowed, size=length))
    for _ in range(10):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return text
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids = ids + list(rng.choice(allowed, size=length - len(ids)))
    # Fall back to whole words, which tokenize stably: one common word is one token or more.
    text = tokenizer.decode(ids[:length], skip_special_tokens=True)
    ids = tokenizer.encode(text, add_special_tokens=False)[:length]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    low = max(1, int(np.floor(mean * (1 - range_ratio))))
    high = max(low, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(low, high + 1, size=n)


def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` random-token prompts (see the module docstring), lengths in tokens."""
    rng = np.random.default_rng(seed)
    allowed = _allowed_token_ids(tokenizer)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        text = _text_of_exact_length(tokenizer, rng, allowed, int(n_in))
        out.append(SampleRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), int(n_out)))
    return out


def synthetic_sharegpt_lengths(num: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) pairs of the built-in sharegpt set.

    Prompt ~ lognormal(median ``SYNTHETIC_SHAREGPT_PROMPT[0]``, sigma ``[1]``) clipped to
    [4, 1024]; output ~ lognormal(median ``SYNTHETIC_SHAREGPT_OUTPUT[0]``, sigma ``[1]``)
    clipped to [4, 2048 - prompt] (vLLM's ShareGPT filters). Right-skewed like real chat
    logs: most prompts are short, a few are long.
    """
    rng = np.random.default_rng(seed)
    (pm, ps), (om, os_) = SYNTHETIC_SHAREGPT_PROMPT, SYNTHETIC_SHAREGPT_OUTPUT
    prompts = np.clip(np.round(rng.lognormal(np.log(pm), ps, size=num)), 4, 1024).astype(int)
    outputs = np.round(rng.lognormal(np.log(om), os_, size=num)).astype(int)
    outputs = np.clip(outputs, 4, 2048 - prompts)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def _synthetic_text(tokenizer, rng: np.random.Generator, length: int) -> str:
    words = rng.choice(_WORDS, size=max(8, length * 2))
    text = " ".join(words)
    ids = tokenizer.encode(text, add_special_tokens=False)[:length]
    return tokenizer.decode(ids, skip_special_tokens=True)


def sharegpt_dataset(tokenizer, num_prompts: int, path: str | None = None, output_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """ShareGPT requests from ``path`` (shuffled with ``seed``) or from the built-in
    synthetic set; ``output_len`` overrides every output length (tokens)."""
    rng = np.random.default_rng(seed)
    out: list[SampleRequest] = []
    if path:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        data = [d for d in data if len(d.get("conversations", d.get("conversation", []))) >= 2]
        order = rng.permutation(len(data))
        for i in order:
            conv = data[i].get("conversations", data[i].get("conversation"))
            prompt, completion = conv[0]["value"], conv[1]["value"]
            p_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            o_len = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
            if p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048:
                continue
            out.append(SampleRequest(prompt, p_len, o_len))
            if len(out) == num_prompts:
                break
        if len(out) < num_prompts:
            raise ValueError(f"{path}: only {len(out)} usable conversations, {num_prompts} requested")
        return out
    for p_len, o_len in synthetic_sharegpt_lengths(num_prompts, seed):
        text = _synthetic_text(tokenizer, rng, p_len)
        out.append(SampleRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len or o_len))
    return out


def shared_prefix_dataset(tokenizer, num_prompts: int, prefix_len: int, input_len: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """``num_prompts`` requests sharing one system prompt of ``prefix_len`` tokens, each
    followed by ``input_len`` tokens of its own; ``output_len`` tokens out."""
    rng = np.random.default_rng(seed)
    allowed = _allowed_token_ids(tokenizer)
    system = _text_of_exact_length(tokenizer, rng, allowed, prefix_len) if prefix_len > 0 else ""
    out = []
    for _ in range(num_prompts):
        text = _text_of_exact_length(tokenizer, rng, allowed, input_len)
        n = len(tokenizer.encode(system + text, add_special_tokens=False))
        out.append(SampleRequest(text, n, output_len, system=system or None))
    return out
