"""What the engine hands back to users: one `RequestOutput` per prompt, vLLM-shaped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token at one position (from the model's raw distribution)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the top-k plus the chosen token).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of the `n` samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request (time.monotonic() seconds; None until they do), and
    the counts the metrics chart per request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    max_tokens: int | None = None  # the request's limit (SamplingParams.max_tokens)


@dataclass
class RequestOutput:
    """A request's state: its prompt and the samples generated so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which
    # nothing predicts). A stream carries them once, in its first output.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
