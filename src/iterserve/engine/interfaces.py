"""What LLMEngine needs from its scheduler and its executor, as Protocols.

The engine is written against these two shapes, not against `core.scheduler.Scheduler` and
`model.runner.ModelRunner` themselves: the lab's simulator, the calibration recorder and the
tests' fake executors and schedulers plug in the same way, and nothing here imports torch.
`core.scheduler.Scheduler` satisfies `EngineScheduler`; `ModelRunner` satisfies `Executor`.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from iterserve.core.request import FinishReason, Request
from iterserve.core.scheduler import SchedulerStats
from iterserve.core.scheduler_output import SampleResult, SchedulerOutput


class Executor(Protocol):
    """Computes a step's chunks and samples the tokens of the chunks that reach the end."""

    def execute(self, output: SchedulerOutput) -> dict[str, SampleResult]: ...


class EngineScheduler(Protocol):
    """The scheduler calls LLMEngine makes (core/scheduler.py documents each)."""

    def add_request(self, request: Request) -> None: ...

    def finish_request(self, request_id: str, reason: FinishReason, *,
                       num_output_tokens: int | None = None) -> Request | None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update_from_output(self, output: SchedulerOutput,
                           sampled: Mapping[str, int | list[int]]) -> list[Request]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> SchedulerStats: ...

    def consistency_violations(self) -> list[tuple[str | None, str]]:
        """(offending request id or None, message) for each disagreement in its books.
        LLMEngine.check_health() looks it up with getattr: a scheduler without it (a test
        fake) is taken as healthy."""
        ...
