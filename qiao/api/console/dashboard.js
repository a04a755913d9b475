// The live dashboard: polls the server's own /metrics (Prometheus text, parsed here), its
// readiness and the Batch API, and shows rates between scrapes and latency percentiles from
// the histogram buckets, per model and version.

import { apiFetch, apiJson, AuthCancelled, errorMessage } from "./api.js";
import { $, el, fmtCount, fmtPercent, fmtRate, fmtSeconds, fmtTime } from "./dom.js";
import {
  bucketDelta,
  histograms,
  mergeBuckets,
  parseMetrics,
  quantile,
  rate,
  sumBy,
} from "./prom.js";

const WINDOW_MS = 60_000; // percentiles and the traffic split: the last minute of scrapes
const KEEP_MS = 5 * 60_000;
const SPARK_POINTS = 60;
const BREAKER_STATES = ["closed", "open", "half-open"];

let history = []; // scrapes {time, samples}, oldest first
let tokenRates = []; // total generated tokens/s of recent polls, for the sparkline
let timer = null;
let visible = false;
let started = false;

export function show() {
  visible = true;
  if (!started) {
    started = true;
    $("dash-interval").addEventListener("change", () => {
      clearTimeout(timer);
      schedule(0);
    });
  }
  schedule(0);
}

export function hide() {
  visible = false;
  clearTimeout(timer);
}

function schedule(delay) {
  clearTimeout(timer);
  const interval = Number($("dash-interval").value);
  if (!visible || (delay !== 0 && interval === 0)) return;
  timer = setTimeout(poll, delay ?? interval);
}

async function poll() {
  const [metrics, ready, batches] = await Promise.allSettled([
    scrape(),
    readiness(),
    apiJson("/v1/batches?limit=10"),
  ]);
  const error = [metrics, batches].find((r) => r.status === "rejected");
  $("dash-error").hidden = !error;
  if (error) $("dash-error").textContent = String(error.reason.message || error.reason);
  const health = ready.status === "fulfilled" ? ready.value : null;
  if (metrics.status === "fulfilled") render(health);
  renderHealth(health);
  if (batches.status === "fulfilled") renderBatches(batches.value.data);
  $("dash-updated").textContent = `updated ${fmtTime(new Date())}`;
  if (!(error && error.reason instanceof AuthCancelled)) schedule();
}

async function scrape() {
  const response = await apiFetch("/metrics");
  if (!response.ok) throw new Error(`/metrics: ${await errorMessage(response)}`);
  const now = Date.now();
  history.push({ time: now, samples: parseMetrics(await response.text()) });
  history = history.filter((s) => now - s.time <= KEEP_MS);
}

/** /health/ready's answer: {ok, reason, breakers} (it needs no key). */
async function readiness() {
  const response = await fetch("/health/ready", { credentials: "omit" });
  const body = await response.json().catch(() => ({}));
  return {
    ok: response.ok,
    reason: response.ok ? "" : body.error?.message || `status ${response.status}`,
    breakers: body.circuit_breakers || {},
  };
}

/** The scrape at least WINDOW_MS before the latest one (or the oldest kept). */
function windowStart() {
  const latest = history[history.length - 1];
  let start = history[0];
  for (const scrape of history) {
    if (latest.time - scrape.time >= WINDOW_MS) start = scrape;
  }
  return start;
}

function requestCounts(samples) {
  const counts = sumBy(samples, "qiao:request_success_total");
  for (const [k, v] of sumBy(samples, "qiao:infer_requests_total")) {
    counts.set(k, (counts.get(k) || 0) + v);
  }
  return counts;
}

/** Everything the page shows, per "model@version" and in total, from the kept scrapes. */
function figures() {
  const now = history[history.length - 1];
  const previous = history.length > 1 ? history[history.length - 2] : null;
  const start = windowStart();
  const seconds = previous ? (now.time - previous.time) / 1000 : 0;
  const s = now.samples;
  const tokens = sumBy(s, "qiao:generation_tokens_total");
  const tokensBefore = previous ? sumBy(previous.samples, "qiao:generation_tokens_total") : null;
  const requests = requestCounts(s);
  const requestsBefore = previous ? requestCounts(previous.samples) : null;
  const requestsAtStart = requestCounts(start.samples);
  const ttft = histograms(s, "qiao:time_to_first_token_seconds");
  const ttftStart = histograms(start.samples, "qiao:time_to_first_token_seconds");
  const itl = histograms(s, "qiao:inter_token_latency_seconds");
  const itlStart = histograms(start.samples, "qiao:inter_token_latency_seconds");
  const gauges = {
    running: sumBy(s, "qiao:num_requests_running"),
    waiting: sumBy(s, "qiao:num_requests_waiting"),
    kv: sumBy(s, "qiao:kv_cache_usage_perc"),
    up: sumBy(s, "qiao:engine_up"),
    restarts: sumBy(s, "qiao:engine_restarts_total"),
    breaker: sumBy(s, "qiao:circuit_breaker_state"),
  };
  const keys = new Set([...tokens.keys(), ...requests.keys(), ...gauges.up.keys()]);
  const rows = [...keys].sort(byModelVersion).map((key) => {
    const ttftWindow = ttft.has(key) ? bucketDelta(ttft.get(key), ttftStart.get(key)) : null;
    const itlWindow = itl.has(key) ? bucketDelta(itl.get(key), itlStart.get(key)) : null;
    return {
      key,
      model: key.slice(0, key.lastIndexOf("@")),
      version: key.slice(key.lastIndexOf("@") + 1),
      isLLM: tokens.has(key),
      tokensRate:
        previous && tokens.has(key) ? rate(tokens.get(key), tokensBefore.get(key), seconds) : NaN,
      requestsRate: previous ? rate(requests.get(key) || 0, requestsBefore.get(key), seconds) : NaN,
      finished: requests.get(key) || 0,
      windowRequests: (requests.get(key) || 0) - (requestsAtStart.get(key) || 0),
      ttft: ttftWindow,
      itl: itlWindow,
      running: gauges.running.get(key),
      waiting: gauges.waiting.get(key),
      kv: gauges.kv.get(key),
      up: gauges.up.get(key),
      restarts: gauges.restarts.get(key),
      breaker: gauges.breaker.has(key) ? BREAKER_STATES[gauges.breaker.get(key)] : undefined,
    };
  });
  return { rows, seconds };
}

function byModelVersion(a, b) {
  const [ma, va] = [a.slice(0, a.lastIndexOf("@")), Number(a.slice(a.lastIndexOf("@") + 1))];
  const [mb, vb] = [b.slice(0, b.lastIndexOf("@")), Number(b.slice(b.lastIndexOf("@") + 1))];
  return ma < mb ? -1 : ma > mb ? 1 : va - vb;
}

function total(rows, field) {
  return rows.reduce((sum, row) => sum + (Number.isFinite(row[field]) ? row[field] : 0), 0);
}

function render(health) {
  const { rows } = figures();
  const breakers = health ? health.breakers : {};
  for (const row of rows) row.breaker = breakers[row.key] || row.breaker;
  const llms = rows.filter((r) => r.isLLM);
  const polled = history.length > 1;
  const tokensRate = polled ? total(llms, "tokensRate") : NaN;
  if (polled) tokenRates = [...tokenRates, tokensRate].slice(-SPARK_POINTS);
  $("dash-tokens-rate").textContent = fmtRate(tokensRate);
  drawSpark();
  $("dash-requests").textContent = fmtCount(total(rows, "finished"));
  $("dash-requests-rate").textContent = polled ? `${fmtRate(total(rows, "requestsRate"))} / s` : "";
  $("dash-queue").textContent =
    `${fmtCount(total(llms, "running"))} / ${fmtCount(total(llms, "waiting"))}`;
  const fullest = llms.reduce((a, b) => ((b.kv ?? -1) > (a?.kv ?? -1) ? b : a), null);
  $("dash-kv").textContent = fullest ? `KV cache ${fmtPercent(fullest.kv)} (${fullest.key})` : "";
  const ttft = mergeBuckets(llms.filter((r) => r.ttft).map((r) => r.ttft));
  const itl = mergeBuckets(llms.filter((r) => r.itl).map((r) => r.itl));
  $("dash-ttft").textContent = fmtSeconds(quantile(0.5, ttft));
  $("dash-ttft-tail").textContent =
    `p90 ${fmtSeconds(quantile(0.9, ttft))} · p99 ${fmtSeconds(quantile(0.99, ttft))}`;
  $("dash-itl").textContent =
    `inter-token p50 ${fmtSeconds(quantile(0.5, itl))} · p99 ${fmtSeconds(quantile(0.99, itl))}`;
  renderVersions(rows);
  renderSplit(rows);
  renderGpus(history[history.length - 1].samples);
}

/** qiao:gpu_* (NVML, GPU machines only): utilisation and memory per device. */
function renderGpus(samples) {
  const byGpu = (labels) => labels.gpu;
  const util = sumBy(samples, "qiao:gpu_utilization_perc", byGpu);
  const used = sumBy(samples, "qiao:gpu_memory_used_bytes", byGpu);
  const installed = sumBy(samples, "qiao:gpu_memory_total_bytes", byGpu);
  const gib = (bytes) => (bytes / 2 ** 30).toFixed(1);
  const lines = [...installed.keys()].map((gpu) => {
    const busy = util.has(gpu) ? fmtPercent(util.get(gpu)) : "—";
    return `GPU ${gpu}: ${busy} busy, ${gib(used.get(gpu) || 0)} / ${gib(installed.get(gpu))} GiB`;
  });
  $("dash-gpu").textContent = lines.join(" · ");
}

function renderVersions(rows) {
  const body = $("dash-versions").tBodies[0];
  const cells = (row) => {
    const q = (h, p) => el("td", { class: "num" }, row.isLLM ? fmtSeconds(quantile(p, h)) : "—");
    return [
      el("td", {}, row.model),
      el("td", {}, row.version),
      el(
        "td",
        { class: "num", "data-field": "tokens-rate" },
        row.isLLM ? fmtRate(row.tokensRate) : "—",
      ),
      el("td", { class: "num" }, fmtRate(row.requestsRate)),
      el("td", { class: "num", "data-field": "finished" }, fmtCount(row.finished)),
      q(row.ttft, 0.5),
      q(row.ttft, 0.9),
      q(row.ttft, 0.99),
      q(row.itl, 0.5),
      q(row.itl, 0.9),
      q(row.itl, 0.99),
      el("td", { class: "num" }, fmtCount(row.running)),
      el("td", { class: "num" }, fmtCount(row.waiting)),
      el("td", { class: "num" }, row.kv === undefined ? "—" : fmtPercent(row.kv)),
      el("td", {}, badge(row.up === undefined ? "—" : row.up ? "up" : "restarting")),
      el("td", { class: "num" }, fmtCount(row.restarts)),
      el("td", {}, badge(row.breaker || "—")),
    ];
  };
  const trs = rows.map((row) => el("tr", { "data-version": row.key }, cells(row)));
  body.replaceChildren(
    ...(trs.length
      ? trs
      : [el("tr", {}, el("td", { colspan: 17, class: "muted" }, "no model series yet"))]),
  );
}

function badge(state) {
  const kind = {
    up: "good",
    closed: "good",
    ready: "good",
    completed: "good",
    restarting: "bad",
    open: "bad",
    "not ready": "bad",
    failed: "bad",
    expired: "bad",
    cancelled: "bad",
    "half-open": "warn",
    validating: "warn",
    in_progress: "warn",
    finalizing: "warn",
    cancelling: "warn",
  }[state];
  return el("span", { class: `badge ${kind || ""}` }, state);
}

/** Per model with more than one version: the share of requests each got, over the window
 *  (or since the versions started, when the window saw none). */
function renderSplit(rows) {
  const models = new Map();
  for (const row of rows) {
    if (!models.has(row.model)) models.set(row.model, []);
    models.get(row.model).push(row);
  }
  const blocks = [];
  for (const [model, versions] of models) {
    const windowed = total(versions, "windowRequests") > 0;
    const field = windowed ? "windowRequests" : "finished";
    const sum = total(versions, field);
    const bar = el("div", { class: "split-bar" });
    const legend = el("div", { class: "split-legend" });
    versions.forEach((row, i) => {
      const share = sum ? row[field] / sum : 0;
      const segment = el("span", {
        class: `seg c${i % 6}`,
        title: `version ${row.version}: ${fmtPercent(share)}`,
      });
      segment.style.width = `${share * 100}%`;
      bar.append(segment);
      legend.append(
        el(
          "span",
          { class: `key c${i % 6}` },
          `v${row.version} ${fmtPercent(share)} (${fmtCount(row[field])})`,
        ),
      );
    });
    const when = windowed ? "last 60 s" : "since start";
    blocks.push(
      el(
        "div",
        { class: "split", "data-model": model },
        el("div", { class: "split-name" }, model, el("span", { class: "muted" }, ` ${when}`)),
        bar,
        legend,
      ),
    );
  }
  $("dash-split").replaceChildren(
    ...(blocks.length ? blocks : [el("p", { class: "muted" }, "no requests yet")]),
  );
}

function renderHealth(health) {
  if (!health) {
    $("dash-ready").textContent = "unreachable";
    return;
  }
  $("dash-ready").replaceChildren(badge(health.ok ? "ready" : "not ready"));
  const breakers = Object.entries(health.breakers);
  const open = breakers.filter(([, state]) => state !== "closed");
  $("dash-ready-detail").textContent = !health.ok
    ? health.reason
    : open.length
      ? `breakers: ${open.map(([k, s]) => `${k} ${s}`).join(", ")}`
      : `${breakers.length} circuit breaker${breakers.length === 1 ? "" : "s"}, all closed`;
}

function renderBatches(batches) {
  if (!batches.length) {
    $("dash-batches").replaceChildren(el("p", { class: "muted" }, "no batches"));
    return;
  }
  const rows = batches.map((b) => {
    const counts = b.request_counts || { total: 0, completed: 0, failed: 0 };
    const done = counts.completed + counts.failed;
    return el(
      "tr",
      { "data-batch": b.id },
      el("td", { class: "mono" }, b.id),
      el("td", {}, b.endpoint || ""),
      el("td", {}, badge(b.status)),
      el("td", {}, el("progress", { max: counts.total || 1, value: done })),
      el("td", { class: "num", "data-field": "progress" }, `${done} / ${counts.total}`),
      el("td", { class: "num" }, counts.failed ? `${counts.failed} failed` : ""),
      el("td", {}, b.created_at ? fmtTime(new Date(b.created_at * 1000)) : ""),
    );
  });
  const head = el(
    "tr",
    {},
    ["batch", "endpoint", "status", "progress", "lines", "", "created"].map((h) => el("th", {}, h)),
  );
  $("dash-batches").replaceChildren(
    el("table", { class: "data" }, el("thead", {}, head), el("tbody", {}, rows)),
  );
}

function drawSpark() {
  const line = $("dash-spark").querySelector("polyline");
  const max = Math.max(1, ...tokenRates);
  const step = 120 / Math.max(1, SPARK_POINTS - 1);
  const offset = (SPARK_POINTS - tokenRates.length) * step;
  const points = tokenRates.map(
    (v, i) => `${(offset + i * step).toFixed(1)},${(29 - (v / max) * 28).toFixed(1)}`,
  );
  line.setAttribute("points", points.join(" "));
}
