"""Adapter life cycle across the cluster: validate, register, load on replicas, unload safely.

Every path is checked (roots, PEFT files, shapes against the base model, rank) before the name
is registered, and an engine load (`add_lora`) must succeed before the name becomes servable:
a bad adapter is refused with a reason and never reaches a generate request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dlora.adapters.registry import AdapterExistsError, AdapterNotFoundError, AdapterRecord, AdapterRegistry
from dlora.adapters.validate import AdapterValidationError, BaseModelShapes, inspect_adapter, is_under_roots
from dlora.cluster.router import Router
from dlora.replica.messages import AdapterRef

log = logging.getLogger(__name__)


class AdapterForbiddenError(PermissionError):
    pass


class AdapterBusyError(RuntimeError):
    pass


def ref_of(rec: AdapterRecord) -> AdapterRef:
    return AdapterRef(name=rec.name, int_id=rec.int_id, path=rec.path)


@dataclass
class AdapterManager:
    registry: AdapterRegistry
    router: Router
    base: BaseModelShapes
    max_rank: int
    roots: tuple[str, ...]
    base_model_name: str
    # engine.max_cpu_loras - engine.max_loras: pinned adapters never leave vLLM's host LoRA cache,
    # and a batch needs max_loras evictable entries (see DloraConfig's check); None = no limit.
    max_pinned: int | None = None

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()

    def pinned_refs(self) -> list[AdapterRef]:
        return [ref_of(r) for r in self.registry.all() if r.pinned]

    def lookup(self, name: str) -> AdapterRecord:
        return self.registry.get(name)

    async def register(self, name: str, path: str, pinned: bool = False, source: str = "api",
                       check_roots: bool = True) -> AdapterRecord:
        """Validate, load on every healthy replica, then record; raise on any problem."""
        if not name or name == self.base_model_name:
            raise AdapterValidationError(f"adapter name {name!r} is empty or clashes with the base model's name")
        if check_roots and self.roots and not is_under_roots(path, self.roots):
            raise AdapterForbiddenError(f"adapter path {path!r} is outside the allowed roots {list(self.roots)}")
        async with self._lock:
            if name in self.registry:
                raise AdapterExistsError(name)
            self._check_pin_room(name, pinned)
            info = await asyncio.to_thread(inspect_adapter, path, self.base, self.max_rank)
            rec = self.registry.add(name, info, pinned=pinned, source=source)
            try:
                await self.router.load_everywhere(ref_of(rec), pinned=pinned)
            except Exception as e:
                self.registry.remove(name)
                await self.router.unload_everywhere(rec.int_id)
                raise AdapterValidationError(f"the engine refused the adapter: {e}") from None
        log.info("registered adapter %s (rank %d, %s) from %s", name, rec.rank, ",".join(rec.target_modules), rec.path)
        return rec

    def _check_pin_room(self, name: str, pinned: bool) -> None:
        if not pinned or self.max_pinned is None:
            return
        held = [r.name for r in self.registry.all() if r.pinned]
        if len(held) >= self.max_pinned:
            raise AdapterValidationError(
                f"cannot pin {name!r}: {len(held)} adapter(s) {held} are pinned already, and engine.max_cpu_loras "
                f"leaves room for {self.max_pinned} pinned besides the engine.max_loras a batch needs; register it "
                "unpinned (it is then loaded on demand) or raise engine.max_cpu_loras")

    async def unregister(self, name: str) -> AdapterRecord:
        async with self._lock:
            rec = self.registry.get(name)
            busy = self.router.inflight_by_adapter.get(name, 0)
            if busy:
                raise AdapterBusyError(f"adapter {name!r} has {busy} request(s) in flight; retry when they finish")
            self.registry.remove(name)
            await self.router.unload_everywhere(rec.int_id)
        log.info("unregistered adapter %s", name)
        return rec

    async def restore(self, config_specs) -> list[str]:
        """Register config adapters and re-register persisted ones; return the problems found."""
        problems = []
        persisted = self.registry.load_persisted()  # read before any add() rewrites the file
        for spec in config_specs:
            try:
                await self.register(spec.name, spec.path, spec.pinned, source="config", check_roots=False)
            except (AdapterValidationError, AdapterExistsError) as e:
                problems.append(f"config adapter {spec.name}: {e}")
        for rec in persisted:
            if rec.name in self.registry:
                continue
            try:
                await self.register(rec.name, rec.path, rec.pinned, source="api", check_roots=False)
            except (AdapterValidationError, AdapterExistsError) as e:
                problems.append(f"persisted adapter {rec.name}: {e}")
        return problems


__all__ = [
    "AdapterBusyError", "AdapterExistsError", "AdapterForbiddenError", "AdapterManager",
    "AdapterNotFoundError", "AdapterValidationError", "ref_of",
]
