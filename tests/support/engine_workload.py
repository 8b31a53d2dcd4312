"""A workload of the real model (8 short questions behind a 96-token shared system prompt) that
mixes prefill and decode, chunks prefills, hits the prefix cache and preempts under ``CONFIG``;
``run`` gives each request's greedy tokens and log-probabilities. The compiled forward and the
fused CPU decode are compared with the eager path on it."""

from __future__ import annotations

from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number larger than ten.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What is 7 times 8?",
    "Who wrote Hamlet?",
    "What colour is grass?",
    "Translate 'thank you' into Spanish.",
]

# logprobs=0: the sampled token's log-probability, compared too (a two-layer cut's greedy tokens
# barely depend on the context, its log-probabilities do)
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=0)
# 8 requests of ~105 prompt tokens (96 shared) + 64 outputs need 6 shared + 8 x 5 blocks of 16 at once: 30 preempt.
CONFIG = dict(num_blocks=30, max_num_batched_tokens=64, enable_prefix_caching=True, max_num_seqs=8)


class Recorder:
    def __init__(self) -> None:
        self.preemptions = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.preemptions += scheduler_stats.num_preemptions


def prompts(tokenizer) -> list[list[int]]:
    system = tokenizer("You are a careful assistant. Answer in one short sentence. " * 12,
                       add_special_tokens=False)["input_ids"][:96]
    return [system + tokenizer(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def run(eng: LLMEngine, batch: list[list[int]], params=GREEDY) -> tuple[list[list[int]], int, list[list[float]]]:
    """Token ids per request, prompt tokens from the cache, and (with ``logprobs``) each sampled
    token's log-probability per request."""
    for i, p in enumerate(batch):
        eng.add_request(f"r{i}-{id(batch)}", p, params)
    final, cached = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                final[out.request_id] = (list(c.token_ids), [e[t].logprob for t, e in zip(c.token_ids, c.logprobs or [])])
                cached += out.num_cached_tokens or 0
    order = sorted(final, key=lambda r: int(r[1:].split("-")[0]))
    return [final[k][0] for k in order], cached, [final[k][1] for k in order]


def count_fused_rows(monkeypatch) -> list[int]:
    """Record the row count of every fused C step (``FusedDecoder.step``) from now on; the list
    fills as steps run (empty: no step ran fused)."""
    from kvfleet.kernels.cpu_decoder import FusedDecoder

    rows: list[int] = []
    step = FusedDecoder.step

    def counting(self, x, *args, **kwargs):
        rows.append(x.shape[0])
        return step(self, x, *args, **kwargs)

    monkeypatch.setattr(FusedDecoder, "step", counting)
    return rows
