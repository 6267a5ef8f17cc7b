"""Why the adapter life cycle refuses a call (`AdapterManager` and on-demand registration raise
these; the registry's and validation's own refusals live with them, in registry.py and validate.py)."""

from __future__ import annotations

from dlora.adapters.registry import AdapterNotFoundError
from dlora.adapters.validate import AdapterValidationError


class AdapterForbiddenError(PermissionError):
    """An adapter path outside `server.adapter_roots`; the message names neither the path nor the roots."""


class AdapterBusyError(RuntimeError):
    pass


class AdapterResolveError(RuntimeError):
    """A resolver found the name, but the files it found failed validation (the reason is logged,
    not told to the client: it may name server paths)."""


class AdapterUnavailableError(AdapterNotFoundError):
    """Registered, but its snapshot was damaged or removed: its requests are refused (as an unknown
    model) rather than handed to an engine that would die re-reading it."""


def described(e: BaseException) -> str:
    """An adapter refusal for the server log: with what the client's message leaves out."""
    return e.described() if isinstance(e, AdapterValidationError) else str(e)
