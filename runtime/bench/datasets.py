"""Workloads of ``kvfleet bench``: lists of prompts with target output lengths.

``kvfleet bench serve`` datasets (text prompts, :class:`SampleRequest`), as in vLLM's
serving benchmark: ``random`` (random token ids re-encoded to exactly the drawn length),
``sharegpt`` (a local ShareGPT-format JSON file, vLLM's filters; without one a built-in
*synthetic* set with ShareGPT's heavy-tailed length shape, :func:`synthetic_sharegpt_lengths`)
and ``shared-prefix`` (one system prompt of ``prefix_len`` tokens shared by every request).
``kvfleet bench compare`` workloads (token-id prompts with exact output lengths,
:class:`Workload`, :func:`make_workload`).

All lengths are tokens of the given tokenizer; everything is drawn from
``numpy.random.default_rng(seed)``, so the same seed gives the same workload.
Definitions and filters: docs/benchmarks.md (``bench serve`` datasets, ``bench compare`` workload).
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


def random_dataset(
    tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0
) -> list[SampleRequest]:
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


def sharegpt_dataset(
    tokenizer, num_prompts: int, path: str | None = None, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
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


def shared_prefix_dataset(
    tokenizer, num_prompts: int, prefix_len: int, input_len: int, output_len: int, seed: int = 0
) -> list[SampleRequest]:
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


# --------------------------------------------------------------------------- bench compare workloads


@dataclass
class Workload:
    """Prompts (token ids) and exact output lengths (tokens), one per request."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.output_lens[:n])


def parse_range(text: str) -> tuple[int, int]:
    """``"16:256"`` -> (16, 256), inclusive token bounds."""
    lo, sep, hi = str(text).partition(":")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise ValueError(f"expected MIN:MAX tokens, got {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return bounds


def sample_lengths(
    n: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int = 0,
    dist: str = "uniform",
    sigma: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths (tokens) within their inclusive ranges.

    ``dist="uniform"``: uniform over each range. ``dist="lognormal"``: heavy-tailed like
    chat logs (ShareGPT): lognormal with median the range's geometric midpoint
    ``sqrt(min * max)`` and shape ``sigma``, rounded and clipped to the range.
    """
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return rng.integers(input_range[0], input_range[1] + 1, size=n), rng.integers(
            output_range[0], output_range[1] + 1, size=n
        )
    if dist != "lognormal":
        raise ValueError(f"length distribution must be uniform or lognormal, got {dist!r}")
    if not sigma > 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")

    def draw(lo: int, hi: int) -> np.ndarray:
        return np.clip(np.round(rng.lognormal(np.log(np.sqrt(lo * hi)), sigma, size=n)), lo, hi).astype(np.int64)

    return draw(*input_range), draw(*output_range)


def make_workload(
    n: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    special_ids=(),
    seed: int = 0,
    dist: str = "uniform",
    sigma: float = 1.0,
) -> Workload:
    """``n`` requests of random (non-special) token ids with lengths from :func:`sample_lengths`."""
    p_lens, o_lens = sample_lengths(n, input_range, output_range, seed, dist, sigma)
    rng = np.random.default_rng(seed + 1)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
    prompts = [rng.choice(allowed, size=int(p)).tolist() for p in p_lens]
    return Workload(prompts, [int(o) for o in o_lens])
