"""Per-version inference statistics, as Triton's statistics extension reports them.

Each served version owns one `InferStatistics`: requests that succeeded and failed (count and
cumulative wall time), the rows they carried (`inference_count`), and, from the batches that ran
them, time queued, time computing, batches executed and a count per batch size. Durations are
integer nanoseconds, summed; a reader divides by the count for an average.

Everything is recorded on the event loop thread (requests end there, and the dynamic batcher
reports each batch there), so no lock is taken: recording is a few integer additions.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from qiao.engine.batcher import BatchStats


@dataclass
class Duration:
    """A count and the nanoseconds it took, summed."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class BatchSizeStats:
    """Batches of one size: how many ran, and their compute time (Triton's `batch_stats`)."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class InferStatistics:
    """One version's counters since it was loaded.

    qiao's backends have no separate input and output phases: `compute_input` and
    `compute_output` count every request run, with 0 ns; all compute time is `compute_infer`."""

    inference_count: int = 0  # rows of successful requests (Triton: one inference per row)
    execution_count: int = 0  # batches executed
    last_inference_ms: int = 0  # wall clock, ms since the epoch; 0 = never
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchSizeStats] = field(default_factory=dict)  # by rows

    @contextlib.contextmanager
    def request(self, rows: int) -> Iterator[None]:
        """Times the block as one request of `rows` rows: a success, or a failure if it raises
        (a cancelled request, its client gone, is neither)."""
        start = time.perf_counter_ns()
        try:
            yield
        except Exception:
            self.fail.add(time.perf_counter_ns() - start)
            raise
        else:
            self.success.add(time.perf_counter_ns() - start)
            self.inference_count += rows
        finally:
            self.last_inference_ms = time.time_ns() // 1_000_000

    def record_batch(self, stats: BatchStats) -> None:
        """One batch the dynamic batcher ran: each request's queue time, and the batch's compute
        time counted once per request it ran (as Triton does)."""
        compute_ns = round(stats.exec_time_s * 1e9)
        self.execution_count += 1
        for queue_s in stats.queue_times_s:
            self.queue.add(round(queue_s * 1e9))
        self._compute(stats.rows, compute_ns, stats.requests)

    def record_execution(self, rows: int, compute_ns: int) -> None:
        """One request run on its own (an LLM's, in continuous batching): no queue time kept."""
        self.execution_count += 1
        self.queue.add(0)
        self._compute(rows, compute_ns, 1)

    def _compute(self, rows: int, compute_ns: int, requests: int) -> None:
        self.compute_input.add(0, requests)
        self.compute_infer.add(compute_ns * requests, requests)
        self.compute_output.add(0, requests)
        batch = self.batches.setdefault(rows, BatchSizeStats())
        batch.compute_input.add(0)
        batch.compute_infer.add(compute_ns)
        batch.compute_output.add(0)
