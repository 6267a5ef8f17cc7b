"""A batch's `metadata`, as OpenAI types it: at most 16 pairs of strings, keys of up to 64
characters, values of up to 512. The strings must be valid Unicode: a lone surrogate ("\\ud800" in
the JSON) cannot be encoded in any response, so a record holding one would break every listing."""

from __future__ import annotations

from dlora.server.errors import APIError

MAX_PAIRS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512
RULE = (
    f"metadata must map at most {MAX_PAIRS} strings of up to {MAX_KEY_CHARS} characters to strings of up "
    f"to {MAX_VALUE_CHARS}, all valid Unicode"
)


def metadata_problem(metadata: object) -> str | None:
    """What is wrong with `metadata`, None when nothing is (None itself is no metadata)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_PAIRS:
        return RULE
    for key, value in metadata.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            return RULE
        if len(key) > MAX_KEY_CHARS or len(value) > MAX_VALUE_CHARS or not (_unicode(key) and _unicode(value)):
            return RULE
    return None


def checked_metadata(metadata: object) -> dict[str, str] | None:
    """`metadata` as it will be stored, or the client's 400 naming `metadata`."""
    problem = metadata_problem(metadata)
    if problem is not None:
        raise APIError(400, problem, "metadata")
    return None if metadata is None else dict(metadata)  # type: ignore[call-overload]


def _unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
