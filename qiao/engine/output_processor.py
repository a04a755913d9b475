"""Turns sampled tokens into user-facing outputs: detokenization, stop strings, logprobs, n-fanout.

A prompt with `n` samples is n scheduler requests ("child" requests) and one `RequestState` here,
which folds the children back into one `RequestOutput` with `n` completions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from qiao.engine.detokenizer import IncrementalDetokenizer
from qiao.engine.request import Request
from qiao.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from qiao.sampling_params import SamplingParams
from qiao.step import ModelRunnerOutput


def set_token_texts(tokenizer: Any, prev: int, entry: dict[int, Logprob]) -> None:
    """Give each logprob entry's token its text as it reads after `prev`: decoded in context,
    so SentencePiece tokens keep their leading space. E.g. after "," "▁there" reads " there"."""
    decode = tokenizer.decode
    base = decode([prev])
    for token_id, logprob in entry.items():
        logprob.decoded_token = decode([prev, token_id])[len(base) :]


def prompt_logprobs_of(
    prompt_token_ids: list[int],
    entries: list[tuple[list[int], list[float], int]],
    tokenizer: Any,
) -> list[dict[int, Logprob] | None]:
    """A request's prompt logprobs as outputs carry them: None for the first token, then per
    token its logprob (and rank) and the top-k, with texts when there is a tokenizer."""
    result: list[dict[int, Logprob] | None] = [None]
    for position, (ids, values, rank) in enumerate(entries):
        entry = {
            token_id: Logprob(value, rank=i)
            for i, (token_id, value) in enumerate(zip(ids, values, strict=True))
            if i > 0
        }
        entry[ids[0]] = Logprob(values[0], rank=rank)
        if tokenizer is not None:
            set_token_texts(tokenizer, prompt_token_ids[position], entry)
        result.append(entry)
    return result


@dataclass
class RequestState:
    """One user request: its prompt and the state of each of its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    completions: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    child_ids: list[str] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Streaming: how many token ids / logprob entries of each completion were already returned.
    sent_tokens: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        # child request id -> (parent id, sample index)
        self.children: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        children: list[Request],
        stream: bool,
    ) -> None:
        params = children[0].params
        detoks = [
            IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params)
            if self.tokenizer is not None
            else None
            for child in children
        ]
        completions = [
            CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(len(children))
        ]
        self.states[request_id] = RequestState(
            request_id,
            prompt,
            children[0].prompt_token_ids,
            params,
            stream,
            completions,
            detoks,
            metrics=RequestMetrics(children[0].arrival_time, max_tokens=params.max_tokens),
            child_ids=[c.request_id for c in children],
            sent_tokens=[0] * len(children),
        )
        for i, child in enumerate(children):
            self.children[child.request_id] = (request_id, i)

    def process(
        self, updated: list[Request], runner_output: ModelRunnerOutput
    ) -> tuple[list[str], list[str]]:
        """Fold this step's tokens in. Returns (touched parent ids, child ids a stop string ended)."""
        row_of = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        now = time.monotonic()
        touched: dict[str, None] = {}
        stopped: list[str] = []
        for request in updated:
            parent_id, index = self.children[request.request_id]
            state = self.states[parent_id]
            touched[parent_id] = None
            completion = state.completions[index]
            if state.prompt_logprobs is None and state.params.prompt_logprobs is not None:
                state.prompt_logprobs = prompt_logprobs_of(
                    request.prompt_token_ids, request.prompt_logprobs, self.tokenizer
                )
            detok = state.detokenizers[index]
            stop_str = None
            # A step verifying draft tokens (speculative decoding) may bring several tokens;
            # a stop string ends the completion at its token, as plain decoding would. (Logprobs
            # come for one token per step: a request asking for them does not speculate.)
            first = request.num_prompt_tokens + len(completion.token_ids)
            for position in range(first, request.num_tokens):
                prev, token_id = request.all_token_ids[position - 1 : position + 1]
                completion.token_ids.append(token_id)
                self._add_logprobs(completion, runner_output, row_of[request.request_id], prev)
                stop_str = detok.update([token_id]) if detok is not None else None
                self._update_metrics(state, request, now)
                if stop_str is not None:
                    break
            if detok is not None:
                completion.text = detok.output_text
            if stop_str is not None:
                completion.finish_reason = "stop"
                completion.stop_reason = stop_str
                if not request.is_finished:
                    stopped.append(request.request_id)
            elif request.is_finished:
                completion.finish_reason = request.status.finish_reason
                completion.stop_reason = request.stop_reason
        return list(touched), stopped

    @staticmethod
    def _update_metrics(state: RequestState, request: Request, now: float) -> None:
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.first_scheduled_time = request.first_scheduled_time
            state.num_cached_tokens = max(request.num_cached_tokens, 0)
        metrics.last_token_time = now
        metrics.num_generation_tokens += 1

    def finish(self, child_id: str, reason: str) -> str | None:
        """Mark one sample finished from outside (abort, deadline); returns its parent id."""
        parent_id, index = self.children.get(child_id, (None, 0))
        if parent_id is None:
            return None
        completion = self.states[parent_id].completions[index]
        if completion.finish_reason is None:
            completion.finish_reason = reason
        return parent_id

    def make_output(self, parent_id: str) -> RequestOutput | None:
        """The request's output now: None for a non-streaming request still running.

        Streaming requests get deltas (new text and token ids since the last output); others get
        one cumulative output when the last sample finishes. A finished request is forgotten.
        """
        state = self.states[parent_id]
        finished = state.finished
        if not state.stream and not finished:
            return None
        if state.stream:
            outputs = [self._delta(state, i) for i in range(len(state.completions))]
        else:
            outputs = state.completions
        if finished:
            state.metrics.finished_time = time.monotonic()
            self._forget(state)
        prompt_logprobs = state.prompt_logprobs
        if state.stream:
            if state.prompt_logprobs_sent:
                prompt_logprobs = None
            state.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            # A snapshot: the engine keeps updating the live one after this output is handed off.
            metrics=dataclasses.replace(state.metrics),
            prompt_logprobs=prompt_logprobs,
        )

    def _delta(self, state: RequestState, index: int) -> CompletionOutput:
        completion = state.completions[index]
        start = state.sent_tokens[index]
        state.sent_tokens[index] = len(completion.token_ids)
        detok = state.detokenizers[index]
        text = detok.get_delta_text(completion.finished) if detok is not None else ""
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=completion.token_ids[start:],
            cumulative_logprob=completion.cumulative_logprob,
            logprobs=completion.logprobs[start:] if completion.logprobs is not None else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _add_logprobs(
        self, completion: CompletionOutput, out: ModelRunnerOutput, row: int, prev: int
    ) -> None:
        if completion.logprobs is None or out.logprobs is None or out.logprobs[row] is None:
            return
        ids, values = out.logprobs[row]
        entry = {
            tid: Logprob(lp, rank=i)
            for i, (tid, lp) in enumerate(zip(ids, values, strict=True))
            if i > 0
        }
        entry[ids[0]] = Logprob(values[0], rank=out.sampled_ranks[row])
        if self.tokenizer is not None:
            set_token_texts(self.tokenizer, prev, entry)
        completion.logprobs.append(entry)
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + values[0]

    def _forget(self, state: RequestState) -> None:
        del self.states[state.request_id]
        for child_id in state.child_ids:
            self.children.pop(child_id, None)


class DeltaDetokenizer:
    """The text half of output processing, for an engine that sends token ids only (an engine
    process; the API process detokenizes): one per request, fed that engine's delta outputs.

    It fills in each sample's text, the logprobs' token texts and stop strings. A stop string
    matches here one step after the engine sampled its last token, so tokens the engine made
    past it are dropped, and the caller tells the engine to stop the samples `process` names.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.samples = [
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params) for _ in range(params.n)
        ]
        self.prompt_token_ids = prompt_token_ids
        self.last_token = [prompt_token_ids[-1]] * params.n
        self.stopped: list[str | None] = [None] * params.n  # the stop string that ended each
        self.cumulative: list[float | None] = [None] * params.n  # each one's, as it ended
        self.num_tokens = 0  # generated tokens kept, all samples

    def process(self, output: RequestOutput) -> tuple[RequestOutput, list[int]]:
        """`output` (a delta) with its texts; and the samples a stop string ended just now."""
        newly_stopped = []
        completions = []
        for c in output.outputs:
            index = c.index
            stop = self.stopped[index]
            if stop is not None:  # ended here earlier: the engine's later tokens are dropped
                completions.append(
                    dataclasses.replace(
                        c,
                        text="",
                        token_ids=[],
                        cumulative_logprob=self.cumulative[index],
                        logprobs=[] if c.logprobs is not None else None,
                        finish_reason="stop",
                        stop_reason=stop,
                    )
                )
                continue
            completion = self._fold(c)
            if self.stopped[index] is not None:
                newly_stopped.append(index)
            completions.append(completion)
        finished = all(c.finish_reason is not None for c in completions)
        metrics = output.metrics
        if metrics is not None:
            metrics = dataclasses.replace(metrics, num_generation_tokens=self.num_tokens)
            if finished and metrics.finished_time is None:
                metrics.finished_time = time.monotonic()
        if output.prompt_logprobs is not None:
            for position, entry in enumerate(output.prompt_logprobs[1:]):
                if entry is not None:
                    set_token_texts(self.tokenizer, self.prompt_token_ids[position], entry)
        result = dataclasses.replace(
            output, outputs=completions, finished=finished, metrics=metrics
        )
        return result, newly_stopped

    def _fold(self, c: CompletionOutput) -> CompletionOutput:
        index = c.index
        detok = self.samples[index]
        kept = 0
        stop: str | None = None
        for token_id in c.token_ids:
            kept += 1
            stop = detok.update([token_id])
            if stop is not None:
                break
        token_ids = c.token_ids[:kept]
        logprobs = c.logprobs
        cumulative = c.cumulative_logprob
        if logprobs is not None:
            dropped = zip(c.token_ids[kept:], logprobs[kept:], strict=False)
            if cumulative is not None:
                cumulative -= sum(entry[tid].logprob for tid, entry in dropped if tid in entry)
            logprobs = logprobs[:kept]
            prev = self.last_token[index]
            for token_id, entry in zip(token_ids, logprobs, strict=False):
                set_token_texts(self.tokenizer, prev, entry)
                prev = token_id
        if token_ids:
            self.last_token[index] = token_ids[-1]
        self.num_tokens += kept
        finish_reason, stop_reason = c.finish_reason, c.stop_reason
        if stop is not None:
            self.stopped[index] = stop
            self.cumulative[index] = cumulative
            finish_reason, stop_reason = "stop", stop
        return CompletionOutput(
            index=index,
            text=detok.get_delta_text(finish_reason is not None),
            token_ids=token_ids,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
