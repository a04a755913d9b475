// The playground: chat and completions against the OpenAI routes, streamed (SSE read from a
// fetch body) or not, with the sampling parameters, per-token logprobs and the usage figures.

import { apiFetch, apiJson, AuthCancelled, errorMessage, sseEvents } from "./api.js";
import { $, el, fmtCount, fmtRate, fmtSeconds, visibleToken } from "./dom.js";

// Number fields sent when filled in; empty ones are left to the server's defaults.
const NUMBER_FIELDS = [
  "temperature",
  "top_p",
  "top_k",
  "max_tokens",
  "seed",
  "presence_penalty",
  "frequency_penalty",
];
const INTEGER_FIELDS = new Set(["top_k", "max_tokens", "seed"]);

let mode = "chat";
let history = []; // the chat so far: {role, content}
let controller = null; // the AbortController of the request in flight
let started = false;

export function show() {
  if (started) return;
  started = true;
  $("pg-mode-chat").addEventListener("click", () => setMode("chat"));
  $("pg-mode-completion").addEventListener("click", () => setMode("completion"));
  $("pg-send").addEventListener("click", send);
  $("pg-stop-button").addEventListener("click", () => controller?.abort());
  $("pg-clear").addEventListener("click", clear);
  $("pg-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) send();
  });
  for (const input of document.querySelectorAll(
    ".params input, .params select, .params textarea",
  )) {
    input.addEventListener("input", () => showRequest(requestBody("…")));
  }
  loadModels();
}

export function hide() {}

async function loadModels() {
  const select = $("pg-model");
  try {
    const { data } = await apiJson("/v1/models");
    // Only generative models answer here; encoders (no max_model_len) are listed, disabled.
    select.replaceChildren(
      ...data.map((m) =>
        el(
          "option",
          { value: m.id, disabled: m.max_model_len === null },
          m.max_model_len === null ? `${m.id} (embeddings)` : m.id,
        ),
      ),
    );
    const first = data.find((m) => m.max_model_len !== null);
    if (first) select.value = first.id;
    select.dataset.loaded = "true";
    showRequest(requestBody("…"));
  } catch (error) {
    showError(
      error instanceof AuthCancelled
        ? `${error.message}: send to try again`
        : `/v1/models: ${error.message}`,
    );
  }
}

function setMode(next) {
  mode = next;
  $("pg-mode-chat").classList.toggle("on", mode === "chat");
  $("pg-mode-completion").classList.toggle("on", mode === "completion");
  $("pg-route").textContent = `POST ${route()}`;
  $("pg-system").hidden = mode !== "chat";
  $("pg-input").placeholder = mode === "chat" ? "Message" : "Prompt";
  clear();
}

function route() {
  return mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
}

function clear() {
  history = [];
  $("pg-transcript").replaceChildren();
  $("pg-usage").replaceChildren();
  showError(null);
}

/** The request body from the form; `text` is the new message (chat) or the prompt. */
function requestBody(text) {
  const body = { model: $("pg-model").value };
  if (mode === "chat") {
    const system = $("pg-system").value.trim();
    body.messages = [
      ...(system ? [{ role: "system", content: system }] : []),
      ...history,
      { role: "user", content: text },
    ];
  } else {
    body.prompt = text;
  }
  for (const field of NUMBER_FIELDS) {
    const raw = $(`pg-${field}`).value.trim();
    if (raw !== "") body[field] = INTEGER_FIELDS.has(field) ? parseInt(raw, 10) : Number(raw);
  }
  const stop = $("pg-stop")
    .value.split("\n")
    .filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  if ($("pg-logprobs").checked) {
    const k = parseInt($("pg-top_logprobs").value || "0", 10);
    if (mode === "chat") {
      body.logprobs = true;
      body.top_logprobs = k;
    } else {
      body.logprobs = k;
    }
  }
  if ($("pg-stream").checked) {
    body.stream = true;
    body.stream_options = { include_usage: true };
  }
  return body;
}

function showRequest(body) {
  $("pg-request").textContent = `POST ${route()}\n${JSON.stringify(body, null, 2)}`;
}

function showError(message) {
  $("pg-error").hidden = !message;
  $("pg-error").textContent = message || "";
}

async function send() {
  const text = $("pg-input").value;
  if (controller || !text.trim() || !$("pg-model").value) {
    if (!$("pg-model").value) loadModels();
    return;
  }
  const body = requestBody(text);
  showRequest(body);
  showError(null);
  $("pg-transcript").querySelector(".empty")?.remove();
  const answer = startTurn(text);
  controller = new AbortController();
  $("pg-send").disabled = true;
  $("pg-stop-button").disabled = false;
  const sent = performance.now();
  const timing = { sent, first: null };
  try {
    const response = await apiFetch(route(), {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const result = body.stream
      ? await readStream(response, answer, timing)
      : await readWhole(response, answer, timing);
    finishTurn(text, answer, result, timing);
  } catch (error) {
    answer.dataset.state = "failed";
    if (error.name === "AbortError") {
      answer.dataset.state = "stopped";
      showError("stopped");
    } else {
      showError(error.message);
    }
  } finally {
    controller = null;
    $("pg-send").disabled = false;
    $("pg-stop-button").disabled = true;
  }
}

/** The user's turn in the transcript, and the element the answer streams into. */
function startTurn(text) {
  const transcript = $("pg-transcript");
  const answer = el("div", { class: "text", "data-state": "streaming", "data-chunks": "0" });
  transcript.append(
    el(
      "div",
      { class: "turn user" },
      el("div", { class: "who" }, mode === "chat" ? "user" : "prompt"),
      el("div", { class: "text" }, text),
    ),
    el(
      "div",
      { class: "turn assistant" },
      el("div", { class: "who" }, mode === "chat" ? "assistant" : "completion"),
      answer,
    ),
  );
  answer.scrollIntoView({ block: "nearest" });
  return answer;
}

async function readStream(response, answer, timing) {
  const result = { text: "", usage: null, finish: null };
  for await (const chunk of sseEvents(response)) {
    if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
    if (chunk.usage) result.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) continue;
    const text = mode === "chat" ? choice.delta?.content || "" : choice.text || "";
    if (choice.finish_reason) result.finish = choice.finish_reason;
    if (!text) continue;
    timing.first ??= performance.now();
    append(answer, text, tokenEntries(choice.logprobs));
    result.text += text;
    answer.dataset.chunks = String(Number(answer.dataset.chunks) + 1);
  }
  return result;
}

async function readWhole(response, answer, timing) {
  const body = await response.json();
  timing.first = performance.now();
  const choice = body.choices[0];
  const text = mode === "chat" ? choice.message.content || "" : choice.text;
  const entries = tokenEntries(choice.logprobs);
  // With logprobs, one span per token; their texts make up the answer.
  if (entries.length && entries.map((e) => e.token).join("") === text) {
    for (const entry of entries) append(answer, entry.token, [entry]);
  } else {
    append(answer, text, entries);
  }
  return { text, usage: body.usage, finish: choice.finish_reason };
}

/** A choice's logprobs as [{token, logprob, top: [{token, logprob}]}], both routes' formats. */
function tokenEntries(logprobs) {
  if (!logprobs) return [];
  if (logprobs.content) {
    return logprobs.content.map((c) => ({
      token: c.token,
      logprob: c.logprob,
      top: c.top_logprobs || [],
    }));
  }
  return (logprobs.tokens || []).map((token, i) => ({
    token,
    logprob: logprobs.token_logprobs[i],
    top: Object.entries(logprobs.top_logprobs?.[i] || {}).map(([t, lp]) => ({
      token: t,
      logprob: lp,
    })),
  }));
}

/** Add `text` to the answer: plain, or as a token span coloured by its probability. */
function append(answer, text, entries) {
  if (!entries.length) {
    answer.append(text);
    return;
  }
  const lowest = Math.min(...entries.map((e) => e.logprob ?? 0));
  const p = Math.exp(lowest);
  const span = el(
    "span",
    {
      class: `tok ${p >= 0.9 ? "p-high" : p >= 0.5 ? "p-mid" : p >= 0.2 ? "p-low" : "p-vlow"}`,
      tabindex: 0,
    },
    text,
  );
  const percent = (logprob) => `${(Math.exp(logprob) * 100).toFixed(1)} %`;
  span.title = entries
    .map((e) => `${visibleToken(e.token)}  logprob ${e.logprob.toFixed(3)}  ${percent(e.logprob)}`)
    .join("\n");
  const detail = () => showToken(entries);
  span.addEventListener("mouseenter", detail);
  span.addEventListener("focus", detail);
  answer.append(span);
}

function showToken(entries) {
  const blocks = entries.map((entry) => {
    const rows = (entry.top.length ? entry.top : [entry]).map((alt) =>
      el(
        "tr",
        { class: alt.token === entry.token ? "chosen" : "" },
        el("td", { class: "mono" }, visibleToken(alt.token)),
        el("td", { class: "num" }, alt.logprob.toFixed(3)),
        el("td", { class: "num" }, `${(Math.exp(alt.logprob) * 100).toFixed(1)} %`),
      ),
    );
    return el(
      "div",
      { class: "token-block" },
      el(
        "div",
        { class: "token-head" },
        el("span", { class: "mono big" }, visibleToken(entry.token)),
        ` logprob ${entry.logprob.toFixed(3)}`,
      ),
      el(
        "table",
        { class: "data" },
        el(
          "thead",
          {},
          el("tr", {}, el("th", {}, "alternative"), el("th", {}, "logprob"), el("th", {}, "p")),
        ),
        el("tbody", {}, rows),
      ),
    );
  });
  $("pg-token-detail").replaceChildren(...blocks);
}

function finishTurn(text, answer, result, timing) {
  answer.dataset.state = "done";
  if (mode === "chat")
    history.push({ role: "user", content: text }, { role: "assistant", content: result.text });
  $("pg-input").value = "";
  const done = performance.now();
  const usage = result.usage;
  const seconds = (done - (timing.first ?? done)) / 1000;
  const items = [
    ["prompt", usage ? fmtCount(usage.prompt_tokens) : "—", "prompt tokens"],
    ["completion", usage ? fmtCount(usage.completion_tokens) : "—", "completion tokens"],
    ["total", usage ? fmtCount(usage.total_tokens) : "—", "total tokens"],
    [
      "first token",
      fmtSeconds(((timing.first ?? done) - timing.sent) / 1000),
      "time to first token, seen here",
    ],
    [
      "tokens/s",
      usage && seconds > 0 ? fmtRate((usage.completion_tokens - 1) / seconds) : "—",
      "after the first token, seen here",
    ],
    ["finish", result.finish || "—", "finish_reason"],
  ];
  $("pg-usage").replaceChildren(
    ...items.map(([name, value, title]) =>
      el("span", { class: "figure", title, "data-usage": name }, el("b", {}, value), ` ${name}`),
    ),
  );
}
