"""The engine: ``LLMEngine`` (synchronous step loop), ``AsyncLLMEngine`` (the server's client),
the incremental detokenizer, per-step stats and the request outputs.
"""
