"""`batch:` = offline batch jobs: upload and request limits, priority, planning, per-owner quotas and
retention."""

from __future__ import annotations

from dataclasses import dataclass

from dlora.config.checks import check, check_kinds

BATCH_PLANNERS = ("stages", "none")


@dataclass(frozen=True)
class BatchConfig:
    """Offline batch jobs (/v1/files, /v1/batches and `dlora batch run`)."""

    max_file_mib: float = 200.0  # an uploaded file's size; larger -> 413
    max_requests: int = 50_000  # lines in one batch's input file (OpenAI's limit); more -> the batch fails
    # The engine priority of batch requests (lower runs first; online requests are 0 unless a client
    # may set its own): queued batch work is admitted after online work and preempted before it.
    priority: int = 1_000_000
    # Batch engine requests (a line of n completions is n of them) in the engines at once while no
    # online request is in flight; None: the engines' max_num_seqs per serving replica. Online
    # requests in flight take their places one for one.
    max_in_flight: int | None = None
    # How a batch's lines are ordered over the replicas: "stages" plans which adapters run merged on
    # which replica and in what order (sample-then-simulate, dlora/batch/plan.py); "none" sends them
    # as they come, to whichever replica dispatch picks.
    planner: str = "stages"
    # With "stages": a stage plan is chosen only when predicted at least this fraction sooner than
    # sending the lines at once (else they are sent at once). Why a margin: each stage boundary
    # waits for a replica's last requests, a tail the plan's simulation prices low; on 2 CPU cores
    # no stage plan has yet beaten sending at once (docs/batch.md).
    min_stage_gain: float = 0.1
    # What one owner (an API key; dlora/server/owners.py) may keep stored: files (uploads and the
    # output/error files its batches write), their bytes, and batches (active or ended, until deleted
    # or removed). An upload or a batch past these -> 429; a batch's own results are always written.
    max_files_per_owner: int = 500
    max_stored_mib_per_owner: float = 2048.0
    max_batches_per_owner: int = 100
    # Days a file is kept after it is made (unless its upload asked otherwise: OpenAI's
    # `expires_after`) and an ended batch after it ended; then they are removed. None: kept until deleted.
    retention_days: float | None = 30.0

    def __post_init__(self) -> None:
        check_kinds(self, "batch")
        for key in ("max_files_per_owner", "max_batches_per_owner"):
            check(getattr(self, key) >= 1, f"batch.{key}", getattr(self, key), "must be a whole number >= 1")
        check(
            0 < self.max_stored_mib_per_owner < float("inf"),
            "batch.max_stored_mib_per_owner",
            self.max_stored_mib_per_owner,
            "must be a finite number > 0",
        )
        check(
            self.retention_days is None or 0 < self.retention_days < float("inf"),
            "batch.retention_days",
            self.retention_days,
            "must be a finite number > 0, or null (keep files and ended batches until they are deleted)",
        )
        check(0 <= self.min_stage_gain < 1, "batch.min_stage_gain", self.min_stage_gain, "must be >= 0 and < 1")
        check(self.planner in BATCH_PLANNERS, "batch.planner", self.planner, f"must be one of {BATCH_PLANNERS}")
        check(self.max_file_mib > 0, "batch.max_file_mib", self.max_file_mib, "must be > 0")
        check(self.max_requests >= 1, "batch.max_requests", self.max_requests, "must be a whole number >= 1")
        check(
            self.max_in_flight is None or self.max_in_flight >= 1,
            "batch.max_in_flight",
            self.max_in_flight,
            "must be a whole number >= 1, or null (max_num_seqs per serving replica)",
        )

    @property
    def max_file_bytes(self) -> int:
        return int(self.max_file_mib * 1024 * 1024)

    @property
    def max_stored_bytes_per_owner(self) -> int:
        return int(self.max_stored_mib_per_owner * 1024 * 1024)

    @property
    def retention_s(self) -> int | None:
        return None if self.retention_days is None else int(self.retention_days * 86400)
