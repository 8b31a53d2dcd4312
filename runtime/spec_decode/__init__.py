"""Speculative decoding: proposers that guess the next tokens, and the rule that accepts them.

- ``config``: :class:`SpeculativeConfig`, vLLM's ``--speculative-config`` shape.
- ``ngram``: prompt lookup (vLLM's ``ngram``, llama.cpp's lookup decoding): the tokens that
  followed the latest earlier occurrence of the context's last n-gram.
- ``suffix``: suffix decoding: a bounded table of the continuations seen after every context of
  up to ``max_depth`` tokens in the request's own prompt and output and in recent requests'
  outputs; proposes the most frequent path while it stays likely enough.
- ``rejection``: verification of k proposed tokens against the target model's k + 1 rows in
  one step: accepted while they equal the rows' own tokens (greedy: exact; sampled: Leviathan et
  al. 2023 / Chen et al. 2023 rejection sampling with coupled draws, which keeps the target
  distribution).

Proposers and ``rejection`` are plain Python/NumPy over token-id lists (no torch).
The model runner owns one proposer per engine and calls it after sampling
(docs/engine.md, "Speculative decoding").
"""
