"""Adapter life cycle across the cluster: validate, register, load on replicas, unload safely.

Every path is checked (roots, PEFT files, shapes against the base model, rank) before the name
is registered, and an engine load (`add_lora`) must succeed before the name becomes servable:
a bad adapter is refused with a reason and never reaches a generate request. Engines are given an
immutable snapshot of the validated files (`validated_copy.py`, `snapshot.py`), never the source
directory. A name a request gives that nobody registered is looked up in `on_demand.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dlora.adapters import snapshot
from dlora.adapters.errors import (
    AdapterBusyError,
    AdapterForbiddenError,
    AdapterResolveError,
    AdapterUnavailableError,
    described,
)
from dlora.adapters.on_demand import OnDemandRegistration
from dlora.adapters.registry import AdapterExistsError, AdapterNotFoundError, AdapterRecord, AdapterRegistry
from dlora.adapters.resolver import AdapterResolver, is_resolvable_name
from dlora.adapters.snapshot import Snapshot
from dlora.adapters.validate import AdapterValidationError, BaseModelShapes, is_under_roots
from dlora.adapters.validated_copy import ValidatedCopies
from dlora.cluster.host_cache import AdapterTooLarge, HostCacheFull
from dlora.cluster.router import Router
from dlora.replica.adapter_source import publish
from dlora.replica.messages import AdapterRef
from dlora.slo.config import AdapterSlo

log = logging.getLogger(__name__)

SNAPSHOT_SUBDIR = "adapters"
RETIRE_POLL_S = 0.2  # how often a replaced version checks whether its last request has finished


def ref_of(rec: AdapterRecord) -> AdapterRef:
    return AdapterRef(
        name=rec.name,
        int_id=rec.int_id,
        path=rec.path,
        version=rec.version,
        size_bytes=rec.size_bytes,
        digest=rec.digest,
        source=rec.content,
    )


def with_content(rec: AdapterRecord, snap: Snapshot | None) -> AdapterRecord:
    """`rec` with its snapshot's digest and, in a Ray cluster, its files in the object store, so a
    replica on a node without the snapshot's directory can load it (none without a snapshot: the
    source directory is read where it is)."""
    if snap is None:
        return rec
    return dataclasses.replace(rec, digest=snap.sha256, content=publish(snap.sha256, snapshot.read_files(snap.path)))


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
    # Where validated copies are kept (`<state_dir>/adapters`); None: serve the sources as given.
    snapshot_root: Path | None = None
    # Tried in order for a name nobody registered (`server.resolve_adapters`); empty: never.
    resolvers: tuple[AdapterResolver, ...] = ()
    # Told each resolution's outcome once ("registered", "not_found", "refused", "source_error"),
    # for /metrics.
    on_resolve: Callable[[str], None] = field(default=lambda outcome: None, repr=False)
    _snapshots: dict[str, Snapshot] = field(default_factory=dict, repr=False)
    _retiring: set[asyncio.Task] = field(default_factory=set, repr=False)  # replaced versions
    _reported: set[str] = field(default_factory=set, repr=False)  # names whose damage was logged

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()
        self._copies = ValidatedCopies(self.base, self.max_rank, self.snapshot_root)
        self._on_demand = OnDemandRegistration(
            self.resolvers,
            self.registry,
            self._register_found,
            self.lookup,
            # Read at each outcome: the server sets on_resolve after building the manager.
            lambda outcome: self.on_resolve(outcome),
        )

    def pinned_refs(self) -> list[AdapterRef]:
        """What a (re)started replica loads first; a pinned adapter whose snapshot is damaged is
        left out, so it cannot keep the replica from starting (its requests are refused)."""
        return [ref_of(r) for r in self.registry.all() if r.pinned and self._servable(r.name)]

    def _servable(self, name: str) -> bool:
        try:
            self.lookup(name)
        except AdapterNotFoundError:
            return False
        return True

    def lookup(self, name: str) -> AdapterRecord:
        rec = self.registry.get(name)
        snap = self._snapshots.get(name)
        if snap is not None and (problem := snap.problem()) is not None:
            if name not in self._reported:  # once, not per request
                self._reported.add(name)
                log.error(
                    "adapter %s cannot be served: its snapshot %s: %s; unload and register it again",
                    name,
                    snap.path,
                    problem,
                )
            raise AdapterUnavailableError(name)
        return rec

    async def lookup_or_resolve(self, name: str) -> AdapterRecord:
        """`lookup`, and for a name nobody registered, the resolvers' answer, registered as an admin
        registration would be. Concurrent first requests for one name share one registration.
        Raises AdapterNotFoundError when no resolver finds it, AdapterResolveError when the files
        found are refused, AdapterSourceError when a source cannot be asked."""
        try:
            return self.lookup(name)
        except AdapterUnavailableError:
            raise
        except AdapterNotFoundError:
            if not self.resolvers or name == self.base_model_name or not is_resolvable_name(name):
                raise
        return await self._on_demand.registered(name)

    async def _register_found(self, name: str, path: str, resolver: AdapterResolver) -> AdapterRecord:
        """Files a resolver found, registered as an admin call would; under the adapter roots only
        when the resolver read them from there."""
        return await self.register(name, path, source="resolver", check_roots=resolver.local_roots_apply)

    async def register(
        self,
        name: str,
        path: str,
        pinned: bool = False,
        source: str = "api",
        check_roots: bool = True,
        version: int = 1,
        inplace: bool = False,
        slo: AdapterSlo | None = None,
    ) -> AdapterRecord:
        """Validate, load (on one replica, on every one if pinned: `Router.place`), then record;
        raise on any problem. With `inplace`, a registered name gets a new version instead (`_update`),
        which keeps its SLO unless `slo` gives a new one; None elsewhere: the server's default SLO."""
        if not name or name == self.base_model_name:
            raise AdapterValidationError(f"adapter name {name!r} is empty or clashes with the base model's name")
        if check_roots and self.roots and not is_under_roots(path, self.roots):
            log.warning("adapter %s refused: %r is outside the adapter roots %s", name, path, list(self.roots))
            raise AdapterForbiddenError("lora_path is outside the allowed adapter roots")
        async with self._lock:
            roots = self.roots if check_roots and self.roots else None
            if inplace and name in self.registry:
                return await self._update(name, path, roots, slo)
            if name in self.registry:
                raise AdapterExistsError(name)
            self._check_pin_room(name, pinned)
            info, snap = await asyncio.to_thread(self._copies.take, name, path, roots)
            rec = self.registry.new_record(name, info, pinned, source, version, slo)
            rec = await self._load_and_commit(await asyncio.to_thread(with_content, rec, snap))
            if snap is not None:
                self._snapshots[name] = snap
        log.info("registered adapter %s (rank %d, %s) from %s", name, rec.rank, ",".join(rec.target_modules), rec.path)
        return rec

    async def _load_and_commit(self, rec: AdapterRecord, replacing: int | None = None) -> AdapterRecord:
        """Load `rec` where it starts out (`Router.place`: one replica, or every one if pinned; a
        new version where the one it is `replacing` is loaded), then record it: an engine has
        accepted it before any request can name it, and other replicas load it when a request
        needs it there. If an engine refuses it, or recording it fails, the loads that did happen
        are undone, so no replica keeps a version nobody can name. Once recorded, the router judges
        the adapter's requests by its SLO."""
        try:
            await self.router.place(ref_of(rec), pinned=rec.pinned, replacing=replacing)
        except (AdapterTooLarge, HostCacheFull) as e:
            await self.router.unload_everywhere(rec.int_id)
            raise AdapterValidationError(str(e)) from None
        except Exception as e:
            await self.router.unload_everywhere(rec.int_id)
            # The engine's words may name files, processes or actors: the server log has them.
            raise AdapterValidationError("the engine refused the adapter", str(e)) from None
        try:
            committed = self.registry.commit(rec)
        except BaseException:
            await self.router.unload_everywhere(rec.int_id)
            raise
        self.router.slo.set_target(committed.name, committed.slo)
        return committed

    async def _update(
        self, name: str, path: str, roots: tuple[str, ...] | None, slo: AdapterSlo | None
    ) -> AdapterRecord:
        """A new version under a new int_id, loaded where the old one is before new requests may name it;
        requests already holding the old version finish on it, then it is unloaded (`_retire`).
        The new files get their own snapshot path, which keys vLLM's prefix cache and dlora's
        merged-weights cache, so nothing computed with the old weights serves the new version."""
        old = self.registry.get(name)
        if not self._copies.enabled():
            raise AdapterValidationError(
                "an in-place update needs adapter snapshots (a writable server.state_dir): without them "
                "both versions would be read from one path; unload the adapter and register it again"
            )
        if old.pinned:
            self._check_pin_room(name, True)  # both versions are pinned until the old one is retired
        info, snap = await asyncio.to_thread(self._copies.take, name, path, roots)
        new = await asyncio.to_thread(with_content, self.registry.next_version(name, info, slo), snap)
        new = await self._load_and_commit(new, replacing=old.int_id)
        if snap is not None:
            self._snapshots[name] = snap
        self._reported.discard(name)
        task = asyncio.create_task(self._retire(old, new))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        log.info("updated adapter %s to version %d from %s", name, new.version, new.path)
        return new

    async def _retire(self, old: AdapterRecord, new: AdapterRecord) -> None:
        """Unload a replaced version once no request holds it any more. A request that took the
        old version just before the update but reaches the router only now is sent to the new one
        (`AdapterResidency.superseded`), so nothing can load the old version again."""
        self.router.residency.supersede(old.int_id, ref_of(new))
        try:
            while self.router.inflight_with(old.int_id):
                await asyncio.sleep(RETIRE_POLL_S)
            await self.router.unload_everywhere(old.int_id)
            log.info("unloaded version %d of adapter %s", old.version, old.name)
        except Exception:
            log.exception("version %d of adapter %s could not be unloaded", old.version, old.name)

    def _check_pin_room(self, name: str, pinned: bool) -> None:
        if not pinned or self.max_pinned is None:
            return
        held = [r.name for r in self.registry.all() if r.pinned]
        if len(held) >= self.max_pinned:
            raise AdapterValidationError(
                f"cannot pin {name!r}: {len(held)} adapter(s) {held} are pinned already, and engine.max_cpu_loras "
                f"leaves room for {self.max_pinned} pinned besides the engine.max_loras a batch needs; register it "
                "unpinned (it is then loaded on demand) or raise engine.max_cpu_loras"
            )

    async def unregister(self, name: str) -> AdapterRecord:
        async with self._lock:
            rec = self.registry.get(name)
            busy = self.router.inflight_by_adapter.get(name, 0)
            if busy:
                raise AdapterBusyError(f"adapter {name!r} has {busy} request(s) in flight; retry when they finish")
            self.registry.remove(name)
            # The snapshot stays on disk until the next start prunes it: an engine may still hold
            # the adapter's path (vLLM reloads a kept merged adapter by path), and a missing file
            # there would kill it.
            self._snapshots.pop(name, None)
            self._reported.discard(name)
            self.router.slo.forget(name)  # its SLO counts and /metrics series go with it
            await self.router.unload_everywhere(rec.int_id)
        log.info("unregistered adapter %s", name)
        return rec

    async def restore(self, config_specs) -> list[str]:
        """Register config adapters and re-register persisted ones; return the problems found."""
        problems = []
        persisted = self.registry.load_persisted()  # read before any add() rewrites the file
        for spec in config_specs:
            try:
                await self.register(spec.name, spec.path, spec.pinned, source="config", check_roots=False, slo=spec.slo)
            except (AdapterValidationError, AdapterExistsError) as e:
                problems.append(f"config adapter {spec.name}: {described(e)}")
        for rec in persisted:
            if rec.name in self.registry:
                continue
            try:
                await self.register(
                    rec.name, rec.path, rec.pinned, source="api", check_roots=False, version=rec.version, slo=rec.slo
                )
            except (AdapterValidationError, AdapterExistsError) as e:
                problems.append(f"persisted adapter {rec.name}: {described(e)}")
        self._copies.prune(r.path for r in self.registry.all())
        return problems


__all__ = [
    "AdapterBusyError",
    "AdapterExistsError",
    "AdapterForbiddenError",
    "AdapterManager",
    "AdapterNotFoundError",
    "AdapterResolveError",
    "AdapterUnavailableError",
    "AdapterValidationError",
    "ref_of",
]
