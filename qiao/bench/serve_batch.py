"""`qiao bench serve --with-batch N`: the online load beside a running /v1/batches job.

The rate ladder runs twice on the same server with the same seeds: alone, then while a batch of
N completion lines (prompts and lengths drawn like the online ones) runs through the Batch API.
The report sets the two side by side: each rate's goodput and p50 TTFT, and the highest rate
whose p99 met the SLO, alone and beside the batch, with the batch's own progress meanwhile
(lines and output tokens per second, and whether it ran the whole time). The batch is cancelled
when the ladder ends, so the server is left as it was found.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import TYPE_CHECKING, Any

import httpx

from qiao.bench.common import WORDS
from qiao.errors import ConfigError

if TYPE_CHECKING:
    from qiao.bench.serve import ServeConfig

TERMINAL = ("completed", "failed", "expired", "cancelled")


def batch_file(cfg: ServeConfig, model: str, lines: int) -> bytes:
    """`lines` OpenAI batch lines for cfg's endpoint, seeded apart from the online prompts."""
    rng = random.Random(cfg.seed + 1_000_003)
    out = []
    for i in range(lines):
        prompt = " ".join(rng.choice(WORDS) for _ in range(cfg.input_len.sample(rng, 1)[0]))
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": cfg.output_len.sample(rng, 1)[0],
            "ignore_eos": True,
        }
        if cfg.temperature is not None:
            body["temperature"] = cfg.temperature
        if cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            url = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            url = "/v1/completions"
        line = {"custom_id": f"bench-{i}", "method": "POST", "url": url, "body": body}
        out.append(json.dumps(line).encode() + b"\n")
    return b"".join(out)


class BackgroundBatch:
    """One batch job on the server under test: started, watched and cancelled."""

    def __init__(self, client: httpx.AsyncClient, cfg: ServeConfig, model: str) -> None:
        self.client, self.cfg, self.model = client, cfg, model
        self.batch_id: str | None = None

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        url = f"{self.cfg.base_url}{path}"
        try:
            response = await self.client.request(method, url, **kwargs)
        except httpx.HTTPError as e:
            raise ConfigError(f"--with-batch: {method} {url} failed ({e})") from None
        if response.status_code == 404 and path.startswith("/v1/files"):
            raise ConfigError(
                f"--with-batch: {url} is not served (404); the server needs the Batch API "
                "(qiao serve has it)"
            )
        if response.status_code >= 400:
            raise ConfigError(
                f"--with-batch: {method} {url}: HTTP {response.status_code}: {response.text[:300]}"
            )
        return response.json()

    async def start(self, lines: int) -> dict[str, Any]:
        """Upload and create the batch; return once its first line is answered (so the
        ladder meets a batch that is computing, not one still being read)."""
        content = batch_file(self.cfg, self.model, lines)
        upload = await self._call(
            "POST",
            "/v1/files",
            files={"file": ("bench-batch.jsonl", content)},
            data={"purpose": "batch"},
        )
        endpoint = "/v1/chat/completions" if self.cfg.endpoint == "chat" else "/v1/completions"
        created = await self._call(
            "POST",
            "/v1/batches",
            json={
                "input_file_id": upload["id"],
                "endpoint": endpoint,
                "completion_window": "24h",
                "metadata": {"created_by": "qiao bench serve --with-batch"},
            },
        )
        self.batch_id = created["id"]
        deadline = time.monotonic() + self.cfg.request_timeout
        while True:
            doc = await self.retrieve()
            counts = doc.get("request_counts") or {}
            if counts.get("completed", 0) + counts.get("failed", 0) > 0:
                return doc
            if doc["status"] in TERMINAL:
                raise ConfigError(f"--with-batch: the batch ended as {doc['status']} at once")
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"--with-batch: no batch line answered within {self.cfg.request_timeout:g} s"
                )
            await asyncio.sleep(0.1)

    async def retrieve(self) -> dict[str, Any]:
        assert self.batch_id is not None
        return await self._call("GET", f"/v1/batches/{self.batch_id}")

    async def cancel(self) -> None:
        if self.batch_id is None:
            return
        doc = await self.retrieve()
        if doc["status"] not in TERMINAL and doc["status"] != "cancelling":
            await self._call("POST", f"/v1/batches/{self.batch_id}/cancel")


def batch_progress(
    before: dict[str, Any], after: dict[str, Any], seconds: float, output_tokens_per_line: float
) -> dict[str, Any]:
    """What the batch did while the ladder ran (between two retrieves `seconds` apart)."""

    def done(doc: dict[str, Any]) -> int:
        counts = doc.get("request_counts") or {}
        return int(counts.get("completed", 0)) + int(counts.get("failed", 0))

    lines = done(after) - done(before)
    return {
        "id": after["id"],
        "total_lines": (after.get("request_counts") or {}).get("total"),
        "lines_during_ladder": lines,
        "lines_per_s": lines / seconds if seconds > 0 else 0.0,
        "output_tokens_per_s": lines * output_tokens_per_line / seconds if seconds > 0 else 0.0,
        "status_after": after["status"],
        # A batch that ended before the ladder did left the later rates alone: the comparison
        # then understates what a batch costs.
        "ran_throughout": after["status"] == "in_progress",
    }


def compare(alone: dict[str, Any], beside: dict[str, Any]) -> dict[str, Any]:
    """Per rate: goodput and p50 TTFT beside the batch over alone; the SLO rates of both."""
    from qiao.bench.serve_report import max_rate_within_p99_slo

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    rates = []
    for a, b in zip(alone["rates"], beside["rates"], strict=True):
        rates.append(
            {
                "request_rate": a["request_rate"],
                "goodput_ratio": ratio(b["goodput"], a["goodput"]),
                "ttft_p50_ratio": ratio(b["ttft_s"]["p50"], a["ttft_s"]["p50"]),
                "itl_p50_ratio": ratio(b["itl_s"]["p50"], a["itl_s"]["p50"]),
            }
        )
    best_alone, best_beside = max_rate_within_p99_slo(alone), max_rate_within_p99_slo(beside)

    def rate_of(best: dict[str, Any] | None) -> float | str | None:
        return None if best is None else best["request_rate"]

    alone_rate, beside_rate = rate_of(best_alone), rate_of(best_beside)
    slo_ratio = None
    if isinstance(alone_rate, float) and alone_rate > 0:
        slo_ratio = (beside_rate if isinstance(beside_rate, float) else 0.0) / alone_rate
    elif alone_rate == "inf":
        slo_ratio = 1.0 if beside_rate == "inf" else None
    return {
        "rates": rates,
        "slo_rate_alone": alone_rate,
        "slo_rate_beside_batch": beside_rate,
        "slo_rate_ratio": slo_ratio,
    }
