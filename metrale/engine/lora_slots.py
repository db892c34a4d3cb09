"""LoraSlots: which LoRA adapters are resident in the runner's bank, and each step's slot per token.

Runs on the MLX thread, owned by the runner. `max_loras` slots (1..max_loras; 0 is "no adapter"):

    step with (A, none, B, A):  ensure A and B resident (load from their folders when not; a full bank
                                evicts its least recently used adapter that no running request uses)
                                token_slots  [sA sA sA | 0 | sB | sA]   (T,) one per scheduled token

An adapter is pinned by the running requests that have used it since they were admitted: a request is
unpinned when it finishes or is preempted (StepInput.finished_request_ids, SchedulerOutput.
preempted_request_ids), so an adapter in use is never evicted. The scheduler admits at most max_loras
distinct adapters among the running requests (SchedulerConfig.max_loras), so an unpinned slot always
exists when a new adapter arrives. The wrappers (metrale.models.lora) are installed at the first
adapter, so an engine that never serves one runs its model untouched.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kernels.runtime import mx, nn
from metrale.models.config import ModelConfig
from metrale.models.lora import LoraBank, install_lora, load_adapter_weights
from metrale.models.lora_spec import lora_targets, read_adapter
from scheduler import LoraRef, ScheduledRequest

logger = logging.getLogger(__name__)


class LoraSlots:
    """The runner's resident adapters (LRU over `max_loras` slots) and the step's token slots."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_rank: int, dtype: mx.Dtype) -> None:
        self._model = model
        self._num_layers = config.num_hidden_layers
        self._targets = lora_targets(config)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._dtype = dtype
        self._bank: LoraBank | None = None  # built, and the model wrapped, at the first adapter
        self._resident: OrderedDict[LoraRef, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._users: dict[int, set[str]] = {}  # slot -> running request ids that use it
        self.num_loads = 0

    @property
    def resident(self) -> tuple[str, ...]:
        """The resident adapters' names, least recently used first."""
        return tuple(ref.name for ref in self._resident)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that finished or were preempted no longer pin their adapter."""
        gone = set(request_ids)
        if gone:
            for users in self._users.values():
                users -= gone

    @contextlib.contextmanager
    def step(self, scheduled: Sequence[ScheduledRequest]) -> Iterator[None]:
        """Make the step's adapters resident and set each token's slot while the forward's graph is built."""
        if all(s.lora is None for s in scheduled):
            yield
            return
        slots = []
        for s in scheduled:
            slot = self._ensure(s.lora, s.request_id) if s.lora is not None else 0
            slots += [slot] * s.num_tokens
        self._bank.token_slots = mx.array(slots, dtype=mx.uint32)  # (T,)
        try:
            yield
        finally:
            self._bank.token_slots = None

    def _ensure(self, ref: LoraRef, request_id: str) -> int:
        slot = self._resident.get(ref)
        if slot is None:
            slot = self._load(ref)
        self._resident.move_to_end(ref)
        self._users.setdefault(slot, set()).add(request_id)
        return slot

    def _load(self, ref: LoraRef) -> int:
        spec = read_adapter(ref.path, self._num_layers, self._targets, self.max_rank)  # the folder may have changed
        if self._bank is None:
            self._bank = LoraBank(self.max_loras, self._dtype)
            install_lora(self._model, self._bank)
        slot = self._free_slot()
        self._bank.load(slot, load_adapter_weights(spec, self._dtype))
        self._resident[ref] = slot
        self.num_loads += 1
        logger.info("LoRA adapter %r (%s, rank %d) loaded into slot %d", ref.name, spec.layout, spec.rank, slot)
        return slot

    def _free_slot(self) -> int:
        taken = set(self._resident.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in taken:
                return slot
        for ref, slot in self._resident.items():  # least recently used first
            if not self._users.get(slot):
                del self._resident[ref]
                logger.info("LoRA adapter %r evicted from slot %d", ref.name, slot)
                return slot
        raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters of running requests "
                           f"({', '.join(self.resident)}): the scheduler admitted more than max_loras")
