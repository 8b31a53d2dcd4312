"""The model runner's LoRA adapters: wrapped layers, slots, and the host-memory cache.

:class:`LoRAManager` wraps every decoder linear layer of the model (all but the LM head, the
layers :func:`kvfleet.runtime.worker.quantization.decoder_linears` names) in a
:class:`~kvfleet.runtime.worker.lora_layers.LoRALinear` and owns two LRU caches, as vLLM's
``LRUCacheWorkerLoRAManager``:

- ``max_loras`` *slots* of the stacked device tensors: the adapters a step may use. A step
  activates its adapters (:meth:`LoRAManager.step`); one not in a slot takes a free slot or
  evicts the least recently used slot no request of the step needs, and its weights are copied
  in (one ``copy_`` per layer, ranks zero-padded to ``max_lora_rank``). The scheduler never puts
  more than ``max_loras`` distinct adapters in one step (:mod:`kvfleet.runtime.core.sched.scheduler`).
- ``max_cpu_loras`` adapters' weights resident in host memory (:class:`LoRAWeights`); an
  adapter evicted from it stays registered and is read from its folder again when a step needs it.

Per step it builds each packed token's slot index (``-1``: base model, :meth:`LoRAManager.token_slots`)
and, on CPU, the slot mask of :func:`kvfleet.kernels.lora.slot_mask`, and sets them as the forward's
LoRA context; the fused CPU decoder (:mod:`kvfleet.runtime.worker.cpu_decode`) takes the slot indices
alone and reads the same slot tensors (:meth:`LoRAManager.adapted_modules` says which layers an
adapter needs).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvfleet.kernels import select_backend
from kvfleet.kernels.lora import slot_mask
from kvfleet.runtime.lora_request import LoRALoadError, LoRANotFoundError, LoRARequest
from kvfleet.runtime.worker.lora_checkpoint import LoRAWeights, load_lora_weights
from kvfleet.runtime.worker.lora_layers import LoRALinear, LoRAStepContext, lora_context
from kvfleet.runtime.worker.quantization import decoder_linears
from kvfleet.runtime.worker.request_state import ScheduledRow

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters of one model (see the module docstring).

    Args:
        model: the transformers model; its decoder linears are replaced in place.
        max_loras: slots; max_lora_rank: slot width; max_cpu_loras: host-memory LRU size.
        device, dtype: where and in which dtype the slots live (the model's).
    """

    def __init__(self, model: torch.nn.Module, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = dtype
        self.layers: dict[str, LoRALinear] = {}
        for name, linear in decoder_linears(model).items():
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            wrapped = LoRALinear(linear, max_loras, max_lora_rank, dtype)
            setattr(parent, leaf, wrapped)
            self.layers[name] = wrapped
        if not self.layers:
            raise ValueError("--enable-lora: the model has no linear layers to adapt")
        self.targets = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        """Adaptable layers: module path -> ``(in_features, out_features)``."""
        self.registered: dict[int, LoRARequest] = {}
        self._cpu: OrderedDict[int, LoRAWeights] = OrderedDict()
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._adapted: dict[int, frozenset[str]] = {}  # lora_int_id -> the module paths it adapts
        self.num_slot_loads = 0
        """Adapters copied into a slot so far (a measure of slot churn)."""

    # ------------------------------------------------------------------ registry
    def add(self, lora: LoRARequest) -> LoRAWeights:
        """Read and check ``lora``'s checkpoint and register it.

        Raises:
            LoRALoadError: the checkpoint cannot be served (why, in the message)."""
        weights = load_lora_weights(lora.lora_path, self.targets, self.max_lora_rank)
        self.registered[lora.lora_int_id] = lora
        self._adapted[lora.lora_int_id] = frozenset(weights.modules)
        self._cache(lora.lora_int_id, weights)
        logger.info("LoRA adapter %s (id %d, rank %d, %d layers, %.1f MiB) from %s", lora.lora_name,
                    lora.lora_int_id, weights.rank, len(weights.modules), weights.num_bytes / 2**20, lora.lora_path)
        return weights

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter: its slot is cleared and its host weights dropped (unknown ids: no-op)."""
        self.registered.pop(lora_int_id, None)
        self._adapted.pop(lora_int_id, None)
        self._cpu.pop(lora_int_id, None)
        slot = self._slots.pop(lora_int_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.set_slot(slot, None, None)

    def _cache(self, lora_int_id: int, weights: LoRAWeights) -> None:
        self._cpu[lora_int_id] = weights
        self._cpu.move_to_end(lora_int_id)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)

    def _weights(self, lora_int_id: int) -> LoRAWeights:
        weights = self._cpu.get(lora_int_id)
        if weights is not None:
            self._cpu.move_to_end(lora_int_id)
            return weights
        lora = self.registered.get(lora_int_id)
        if lora is None:
            raise LoRANotFoundError(f"LoRA adapter id {lora_int_id} is not loaded")
        try:  # evicted from host memory: read its folder again
            weights = load_lora_weights(lora.lora_path, self.targets, self.max_lora_rank)
        except LoRALoadError as exc:
            raise RuntimeError(f"LoRA adapter {lora.lora_name!r} could not be read again: {exc}") from exc
        self._cache(lora_int_id, weights)
        return weights

    def adapted_modules(self, lora_int_id: int) -> frozenset[str]:
        """The module paths (keys of :attr:`layers`) that a registered adapter adapts.

        Raises:
            LoRANotFoundError: an id that is not registered."""
        modules = self._adapted.get(lora_int_id)
        if modules is None:
            raise LoRANotFoundError(f"LoRA adapter id {lora_int_id} is not loaded")
        return modules

    @property
    def resident_ids(self) -> list[int]:
        """Adapters whose weights are in host memory, least recently used first."""
        return list(self._cpu)

    # ------------------------------------------------------------------ slots
    def activate(self, lora_ids: Sequence[int]) -> dict[int, int]:
        """Put every adapter of ``lora_ids`` (distinct, ``0`` skipped) into a slot.

        Returns: ``lora_int_id -> slot``.

        Raises:
            RuntimeError: more than ``max_loras`` distinct adapters (the scheduler prevents it).
            LoRANotFoundError: an id that is not registered."""
        wanted = [i for i in dict.fromkeys(lora_ids) if i]
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras ({self.max_loras})")
        for i in wanted:
            if i in self._slots:
                self._slots.move_to_end(i)
        for i in wanted:
            if i in self._slots:
                continue
            weights = self._weights(i)
            used = set(self._slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # evict the least recently used slot this step does not need
                victim = next(v for v in self._slots if v not in wanted)
                slot = self._slots.pop(victim)
            for name, layer in self.layers.items():
                a_b = weights.modules.get(name)
                layer.set_slot(slot, *(a_b if a_b is not None else (None, None)))
            self._slots[i] = slot
            self.num_slot_loads += 1
        return {i: self._slots[i] for i in wanted}

    def token_slots(self, scheduled: Sequence[ScheduledRow]) -> tuple[torch.Tensor, int] | None:
        """Each packed token's slot (``[T]`` int64 on the CPU, -1: base model), its adapters put into
        slots (:meth:`activate`), and the highest slot + 1; None when no scheduled request has an adapter."""
        ids = [s.request.lora_int_id for s in scheduled]
        if not any(ids):
            return None
        slots = self.activate(ids)
        per_request = [slots.get(i, -1) for i in ids]
        counts = [s.num_new_tokens for s in scheduled]
        token_slots = torch.repeat_interleave(torch.tensor(per_request, dtype=torch.long),
                                              torch.tensor(counts, dtype=torch.long))
        return token_slots, max(per_request) + 1

    def make_context(self, scheduled: Sequence[ScheduledRow]) -> LoRAStepContext | None:
        """The step's per-token slots (and CPU mask); None when no scheduled request has an adapter."""
        slots = self.token_slots(scheduled)
        if slots is None:
            return None
        token_slots, k = slots[0].to(self.device), slots[1]
        mask = None
        if select_backend(self.device) != "triton":  # the torch path (CPU) takes the mask
            mask = slot_mask(token_slots, k, self.max_lora_rank, self.dtype)
        return LoRAStepContext(token_slots=token_slots, mask=mask)

    @contextmanager
    def step(self, scheduled: Sequence[ScheduledRow]) -> Iterator[LoRAStepContext | None]:
        """``with manager.step(scheduled): model(...)``: the forward sees the step's adapters."""
        with lora_context(self.make_context(scheduled)) as ctx:
            yield ctx


_MANAGER_ATTR = "_kvfleet_lora_manager"


def shared_lora_manager(model: torch.nn.Module, config, device: torch.device, dtype: torch.dtype) -> LoRAManager:
    """The model's LoRA manager, made on first use: engines sharing one loaded model share its
    wrapped layers and slots (adapter ids are unique per process, so their registries do not
    clash). ``config``: the :class:`~kvfleet.runtime.config.EngineConfig` (``max_loras``,
    ``max_lora_rank``, ``max_cpu_loras``).

    Raises:
        ValueError: the model was prepared for LoRA with other ``max_loras`` / ``max_lora_rank``."""
    max_cpu = config.max_cpu_loras or config.max_loras
    manager = getattr(model, _MANAGER_ATTR, None)
    if manager is None:
        manager = LoRAManager(model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                              max_cpu_loras=max_cpu, device=device, dtype=dtype)
        setattr(model, _MANAGER_ATTR, manager)
        return manager
    if (manager.max_loras, manager.max_lora_rank) != (config.max_loras, config.max_lora_rank):
        raise ValueError(f"--max-loras {config.max_loras} / --max-lora-rank {config.max_lora_rank}: this loaded model "
                         f"already serves adapters with {manager.max_loras} / {manager.max_lora_rank}")
    manager.max_cpu_loras = max(manager.max_cpu_loras, max_cpu)
    return manager
