"""StepExecutor: runs one step on the MLX thread and contains its failures.

A step whose execution raises is retried with its batch split in halves, depth first and in
scheduled order, until every request has either run in a sub-batch that succeeded or failed alone
twice (a culprit). A deterministic culprit therefore fails alone and a transient fault fails
nobody:

    [a b c d] fails -> [a b] ok            -> a, b get their tokens
                       [c d] fails -> [c] ok, [d] fails, [d] fails again -> d is the culprit

Sub-batches run in scheduled order, so a block one request computes this step is written before a
later request of the same step reads it through a prefix hit. A culprit's blocks were never
written: the requests that share one of them in this step are failed with it (their attention read
garbage). KV writes of a failed attempt land in the same slots the retry rewrites, or in the
culprits' blocks, which are freed with their hashes discarded.
"""

from __future__ import annotations

import logging

from metrale.engine.mlx_thread import MLXThread
from metrale.engine.runner import StepInput
from metrale.engine.step import RowError, RowResult
from metrale.errors import TensorParallelError
from scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class StepExecutor:
    """Executes steps through `runner.execute` on the MLX thread, bisecting failures."""

    def __init__(self, runner, mlx_thread: MLXThread) -> None:
        self._runner = runner
        self._mlx = mlx_thread

    async def execute(self, step: StepInput) -> dict[str, RowResult]:
        """Run the step; on failure, its sub-batches. Returns each request's record (request id -> it):
        a culprit's carries its error (RowError.kv_unwritten)."""
        outcome: dict[str, RowResult] = {}
        output = step.scheduler_output
        error = await self._try(output.scheduled, step, outcome)
        if error is None:
            return outcome
        logger.warning("step of %d requests failed (%s: %s); retrying in halves to find the culprit",
                       len(output.scheduled), type(error).__name__, error)
        await self._bisect(output.scheduled, step, outcome)
        self._fail_sharers(output, outcome)
        return outcome

    async def _try(self, group: tuple[ScheduledRequest, ...], step: StepInput,
                   outcome: dict[str, RowResult]) -> BaseException | None:
        """Run `group` as one batch; merge its results into `outcome`, or return the error."""
        sub = step if len(group) == len(step.scheduler_output.scheduled) else step.for_group(group)
        try:
            result = await self._mlx.run(self._runner.execute, sub)
        except TensorParallelError:  # a rank is gone: no sub-batch can run either, the engine dies
            raise
        except Exception as error:  # contained: the caller splits the batch
            return error
        outcome.update((row.request_id, row) for row in result)
        return None

    async def _bisect(self, group: tuple[ScheduledRequest, ...], step: StepInput,
                      outcome: dict[str, RowResult]) -> None:
        if len(group) == 1:  # it failed inside a larger batch: two tries alone, then it is the culprit
            error = await self._try(group, step, outcome)
            if error is not None:
                error = await self._try(group, step, outcome)
            if error is not None:
                logger.error("request %s fails alone: %s: %s", group[0].request_id, type(error).__name__, error)
                request_id = group[0].request_id
                outcome[request_id] = RowResult(request_id, error=RowError.of(error, kv_unwritten=True))
            return
        middle = len(group) // 2
        for half in (group[:middle], group[middle:]):
            if len(half) == 1 or await self._try(half, step, outcome) is not None:
                await self._bisect(half, step, outcome)

    @staticmethod
    def _fail_sharers(output: SchedulerOutput, outcome: dict[str, RowResult]) -> None:
        """Fail the requests that share a block a culprit was computing this step."""
        culprits = {rid for rid, row in outcome.items() if row.error is not None and row.error.kv_unwritten}
        if not culprits:
            return
        size = output.block_size
        unwritten: dict[int, str] = {}  # block id -> the culprit that was computing it
        for s in output.scheduled:
            if s.request_id in culprits:
                first, last = s.start_position // size, (s.start_position + s.num_tokens - 1) // size
                unwritten.update({block: s.request_id for block in s.block_table[first:last + 1]})
        for s in output.scheduled:
            if s.request_id in culprits:
                continue
            culprit = next((unwritten[b] for b in s.block_table if b in unwritten), None)
            if culprit is not None:
                error = RuntimeError(f"shares a KV block that failed request {culprit!r} was computing")
                outcome[s.request_id] = RowResult(s.request_id, error=RowError.of(error, kv_unwritten=True))
