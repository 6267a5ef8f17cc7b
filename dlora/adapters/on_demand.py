"""Registering an adapter when a request first names it (`server.resolve_adapters`): the resolvers
are asked in order, what they find is registered as an admin call would register it, and each
outcome is remembered for a while so that clients repeating a name cannot turn every request into
lookups, copies and hashes."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from dlora.adapters.errors import AdapterForbiddenError, AdapterResolveError, described
from dlora.adapters.registry import AdapterExistsError, AdapterNotFoundError, AdapterRecord, AdapterRegistry
from dlora.adapters.registry_store import RegistryPersistError
from dlora.adapters.resolver import AdapterResolver, AdapterSourceError
from dlora.adapters.validate import AdapterValidationError

log = logging.getLogger(__name__)

# A name whose found files failed validation is not tried again for this long: a client repeating
# it must not make the server copy and hash the same bad files on every request.
RESOLVE_RETRY_S = 30.0
# A name no resolver found is not looked up again for this long (at most MISSING_REMEMBERED names):
# a client sending made-up names must not turn each request into disk or object-store lookups.
MISSING_RETRY_S = 5.0
MISSING_REMEMBERED = 10_000


def _recent(memory: OrderedDict[str, float], name: str, for_s: float) -> bool:
    return time.monotonic() - memory.get(name, -for_s) < for_s


def _remember(memory: OrderedDict[str, float], name: str) -> None:
    """When `name` last had this outcome; the oldest of more than MISSING_REMEMBERED names go."""
    memory[name] = time.monotonic()
    memory.move_to_end(name)
    while len(memory) > MISSING_REMEMBERED:
        memory.popitem(last=False)


@dataclass
class OnDemandRegistration:
    resolvers: tuple[AdapterResolver, ...]
    registry: AdapterRegistry
    # Registers the files a resolver found at a path, as `AdapterManager.register` does.
    register: Callable[[str, str, AdapterResolver], Awaitable[AdapterRecord]]
    lookup: Callable[[str], AdapterRecord]
    # Told each resolution's outcome once ("registered", "not_found", "refused", "source_error").
    on_resolve: Callable[[str], None]
    _resolving: dict[str, asyncio.Future] = field(default_factory=dict, repr=False)
    _failed_at: OrderedDict[str, float] = field(default_factory=OrderedDict, repr=False)
    _missing_at: OrderedDict[str, float] = field(default_factory=OrderedDict, repr=False)
    _unreachable_at: OrderedDict[str, float] = field(default_factory=OrderedDict, repr=False)

    async def registered(self, name: str) -> AdapterRecord:
        """`name` registered from what the resolvers find; concurrent first requests for one name
        share one registration."""
        pending = self._resolving.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._resolve(name))
            self._resolving[name] = pending
            pending.add_done_callback(lambda _: self._resolving.pop(name, None))
        # Shielded: a waiter whose client went away must not cancel the others' registration.
        return await asyncio.shield(pending)

    async def _resolve(self, name: str) -> AdapterRecord:
        if _recent(self._failed_at, name, RESOLVE_RETRY_S):
            raise AdapterResolveError(name)
        if _recent(self._missing_at, name, MISSING_RETRY_S):
            raise AdapterNotFoundError(name)
        if _recent(self._unreachable_at, name, MISSING_RETRY_S):
            raise AdapterSourceError(name)
        found: tuple[str, AdapterResolver] | None = None
        try:
            found = await self._find(name)
            if found is None:
                _remember(self._missing_at, name)
                self.on_resolve("not_found")
                raise AdapterNotFoundError(name)
            rec = await self.register(name, *found)
        except AdapterExistsError:  # registered meanwhile by an admin call
            return self.lookup(name)
        except (AdapterValidationError, AdapterForbiddenError) as e:
            _remember(self._failed_at, name)
            self.on_resolve("refused")
            log.warning("adapter %s was found but refused: %s", name, described(e))
            raise AdapterResolveError(name) from None
        except (AdapterSourceError, OSError, RegistryPersistError) as e:
            _remember(self._unreachable_at, name)
            self.on_resolve("source_error")
            log.warning("adapter %s could not be looked up: %s", name, e)
            raise AdapterSourceError(name) from None
        finally:
            if found is not None and not found[1].local_roots_apply:
                self._discard_download(name, found[0])
        for memory in (self._failed_at, self._missing_at, self._unreachable_at):
            memory.pop(name, None)
        self.on_resolve("registered")
        return rec

    def _discard_download(self, name: str, path: str) -> None:
        """A downloading resolver's files once registration is over: engines read the snapshot,
        so keeping them would let clients fill the disk by naming adapters. Without snapshots the
        engines read the download itself, which then stays while the adapter is registered."""
        rec = self.registry.get(name) if name in self.registry else None
        if rec is None or Path(rec.path) != Path(path):
            shutil.rmtree(path, ignore_errors=True)

    async def _find(self, name: str) -> tuple[str, AdapterResolver] | None:
        """The first resolver's answer that is not None, and which resolver gave it."""
        for resolver in self.resolvers:
            path = await asyncio.to_thread(resolver.resolve, name)
            if path is not None:
                return path, resolver
        return None
