"""Where two OpenAI API answers (tests/vllm_reference.send) differ, field by field and chunk by chunk,
beyond what differs between any two servers or any two runs: ids, creation times, the server's
fingerprint, error messages, and float rounding."""

from __future__ import annotations

import json
import math

# Random per response (ids of responses, chunks and tool calls), the clock, and the server's build.
MASKED = frozenset({"id", "created", "system_fingerprint"})
# Servers with the same engine arguments give the same fp32 logprobs to the bit; these tolerances
# are for kernels that sum in another order (another batch shape, another backend).
LOGPROB_ABS_TOL = 1e-4
# The tiny model's logits are in the hundreds, so a logprob below about -100 is the difference of
# two large fp32 numbers whose rounding alone exceeds 1e-4 (up to 2e-4 seen around -300..-690):
# compared relatively there.
HUGE = 100.0
HUGE_REL_TOL = 1e-5
# The fields of a stream's chunk whose text the next chunk continues.
TEXT_FIELDS = frozenset({"text", "content", "reasoning"})


def differences(ours: dict, ref: dict) -> list[str]:
    """Each difference as "where: ours != reference"; empty when the answers agree."""
    if ours["status"] != ref["status"]:
        return [f"status: {ours['status']} != {ref['status']} ({_brief(ours)} vs {_brief(ref)})"]
    if "error" in ref.get("body", {}):
        return _error_differences(ours["body"], ref["body"])
    if "chunks" in ref:
        return _stream_differences(ours, ref) if "chunks" in ours else [f"not a stream: {_brief(ours)}"]
    return tree_differences(ours["body"], ref["body"], "body")


def _stream_differences(ours: dict, ref: dict) -> list[str]:
    """Streams agree choice by choice, chunk by chunk where both servers cut their chunks at the same
    place in the text. vLLM's server merges the deltas of consecutive steps into one chunk when its
    API loop falls behind the engine (RequestOutputCollector), so where a chunk ends is timing, in
    vLLM's answers as in dlora's: where one side merged, the other side's chunks are merged alike."""
    found = tree_differences(ours["done"], ref["done"], "[DONE]")
    ours_lanes, ref_lanes = lanes(ours["chunks"]), lanes(ref["chunks"])
    found += tree_differences(sorted(ours_lanes), sorted(ref_lanes), "stream's choices")
    for lane, chunks in ref_lanes.items():
        mine = ours_lanes.get(lane, [])
        cuts = set(_ends(mine)) & set(_ends(chunks))
        found += tree_differences(segments(mine, cuts), segments(chunks, cuts), f"{lane} chunks")
    return found


def lanes(chunks: list[dict]) -> dict[str, list[dict]]:
    """A stream's chunks by the choice they carry, in order (the usage chunk, which carries none,
    by itself). The choices of one request (`n` > 1) are sequences of their own, generated side by
    side: how their chunks interleave is the engine's step timing, in vLLM's server as in dlora."""
    found: dict[str, list[dict]] = {}
    for chunk in chunks:
        indices = sorted({c["index"] for c in chunk.get("choices", [])})
        found.setdefault(f"choice {indices}" if indices else "usage", []).append(chunk)
    return found


def segments(chunks: list[dict], cuts: set[int]) -> list[object]:
    """The chunks, each run of them that ends between two cuts (text lengths) merged into one; a
    chat message's opening chunk (its role, sent before any engine output) always by itself."""
    out: list[object] = []
    pending: object = None
    ends = _ends(chunks)
    for i, chunk in enumerate(chunks):
        pending = chunk if pending is None else merged(pending, chunk)
        last_at_this_end = i + 1 == len(chunks) or ends[i + 1] != ends[i]
        if _opens_message(chunk) or (ends[i] in cuts and last_at_this_end) or i + 1 == len(chunks):
            out.append(pending)
            pending = None
    return out


def merged(a: object, b: object, key: str = "") -> object:
    """Two consecutive chunks as one, as vLLM's server merges deltas: texts and lists joined, a
    value that comes later (a finish reason) kept; two other values that differ, both kept (and so
    reported)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: merged(a[k], b[k], k) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
    if key == "choices" and isinstance(a, list) and isinstance(b, list):
        return [merged(x, y) for x, y in zip(a, b)]  # a lane's chunks carry its one choice
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if key in TEXT_FIELDS and isinstance(a, str) and isinstance(b, str):
        return a + b
    if a is None or b is None or a == b:
        return a if b is None else b
    return [a, b]


def _opens_message(chunk: dict) -> bool:
    return any("role" in (choice.get("delta") or {}) for choice in chunk.get("choices", []))


def _ends(chunks: list[dict]) -> list[int]:
    """Where each chunk ends in its choice's text (a completion's text, a chat delta's content)."""
    ends, total = [], 0
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            total += len(choice.get("text") or choice.get("delta", {}).get("content") or "")
        ends.append(total)
    return ends


def _error_differences(ours: dict, ref: dict) -> list[str]:
    """Errors agree by status, type, param and code; the message is free text."""
    if "error" not in ours:
        return [f"not an error: {ours}"]
    return [
        f"error.{key}: {ours['error'].get(key)!r} != {ref['error'].get(key)!r} ({ours['error'].get('message')})"
        for key in ("type", "param", "code")
        if ours["error"].get(key) != ref["error"].get(key)
    ]


def tree_differences(ours: object, ref: object, where: str) -> list[str]:
    if isinstance(ref, dict) and isinstance(ours, dict):
        found = [f"{where}: no {k!r}" for k in ref if k not in ours]
        found += [f"{where}: extra {k!r}" for k in ours if k not in ref]
        for k in ref:
            if k in ours and k not in MASKED:
                found += tree_differences(ours[k], ref[k], f"{where}.{k}")
        return found
    if isinstance(ref, list) and isinstance(ours, list):
        found = [f"{where}: {len(ours)} items != {len(ref)}"] if len(ours) != len(ref) else []
        for i, (a, b) in enumerate(zip(ours, ref)):
            found += tree_differences(a, b, f"{where}[{i}]")
        return found
    if isinstance(ref, float) or isinstance(ours, float):
        return [] if _close(ours, ref) else [f"{where}: {ours!r} != {ref!r}"]
    return [] if ours == ref and type(ours) is type(ref) else [f"{where}: {ours!r} != {ref!r}"]


def _close(ours: object, ref: object) -> bool:
    if isinstance(ours, bool) or isinstance(ref, bool):
        return False
    if not isinstance(ours, int | float) or not isinstance(ref, int | float):
        return False
    if min(abs(ours), abs(ref)) > HUGE:
        return math.isclose(ours, ref, rel_tol=HUGE_REL_TOL)
    return abs(ours - ref) <= LOGPROB_ABS_TOL


def _brief(answer: dict) -> str:
    return json.dumps(answer.get("body", answer.get("chunks", "")))[:300]
