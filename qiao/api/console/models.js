// The models page: every version of every model and its state. On the main listener it reads
// the read-only repository index (POST /v2/repository/index) and the requests each version
// served (/metrics). On the management listener it reads GET /v1/repository and loads,
// reloads, unloads and sets traffic weights, all with the management token.

import { apiFetch, apiJson, AuthCancelled, errorMessage } from "./api.js";
import { $, el, fmtCount, fmtPercent, fmtTime } from "./dom.js";
import { parseMetrics, sumBy } from "./prom.js";

const REFRESH_MS = 3000;
const management = document.body.dataset.listener === "management";

const cards = new Map(); // model -> {root, tbody, traffic, versions}
let timer = null;
let visible = false;
let started = false;
let busy = false; // an action is running: refreshes wait for it

export function show() {
  visible = true;
  if (!started) {
    started = true;
    $("models-refresh").addEventListener("click", () => refresh());
    $("models-note").textContent = management
      ? "Management listener: reload picks up new or replaced versions; " +
        "unload and traffic act at once."
      : "Read-only here. Loading, unloading and traffic weights run on the management listener " +
        "(qiao serve --management-port): open /ui there.";
    if (management) addLoadForm();
  }
  refresh();
}

export function hide() {
  visible = false;
  clearTimeout(timer);
}

async function refresh() {
  clearTimeout(timer);
  if (busy) return;
  try {
    const [rows, served] = management ? [await managementIndex(), null] : await mainIndex();
    render(rows, served);
    $("models-updated").textContent = `updated ${fmtTime(new Date())}`;
  } catch (error) {
    status(
      error instanceof AuthCancelled
        ? `${error.message}: press Refresh to enter one`
        : error.message,
      true,
    );
    if (error instanceof AuthCancelled) return;
  }
  if (visible) timer = setTimeout(refresh, REFRESH_MS);
}

async function managementIndex() {
  return (await apiJson("/v1/repository")).models;
}

/** The read-only index and, per "model@version", the requests it served since it started. */
async function mainIndex() {
  const rows = await apiJson("/v2/repository/index", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: "{}",
  });
  const response = await apiFetch("/metrics");
  if (!response.ok) throw new Error(`/metrics: ${await errorMessage(response)}`);
  const samples = parseMetrics(await response.text());
  const served = sumBy(samples, "qiao:request_success_total");
  for (const [k, v] of sumBy(samples, "qiao:infer_requests_total"))
    served.set(k, (served.get(k) || 0) + v);
  return [rows, served];
}

function render(rows, served) {
  const byModel = new Map();
  for (const row of rows) {
    if (!byModel.has(row.name)) byModel.set(row.name, []);
    byModel.get(row.name).push({ ...row, state: row.state.toLowerCase() });
  }
  for (const [model, card] of cards) {
    if (!byModel.has(model)) {
      card.root.remove();
      cards.delete(model);
    }
  }
  if (!byModel.size) {
    $("models-list").replaceChildren(el("p", { class: "muted" }, "no models"));
    return;
  }
  $("models-list").querySelector(":scope > p")?.remove();
  for (const [model, versions] of byModel) {
    const card = cards.get(model) || newCard(model);
    fillCard(card, model, versions, served);
  }
}

function newCard(model) {
  const tbody = el("tbody");
  const headings = [
    "version",
    "state",
    "circuit breaker",
    ...(management ? [] : ["requests", "share"]),
    "reason",
  ];
  const numeric = new Set(["requests", "share"]);
  const head = el(
    "tr",
    {},
    headings.map((h) => el("th", { class: numeric.has(h) ? "num" : null }, h)),
  );
  const root = el(
    "div",
    { class: "model-card", "data-model": model },
    el("h2", {}, model),
    el("table", { class: "data" }, el("thead", {}, head), tbody),
  );
  const card = { root, tbody, traffic: null, versions: "" };
  if (management) root.append(actions(model, card));
  $("models-list").append(root);
  cards.set(model, card);
  return card;
}

function fillCard(card, model, versions, served) {
  const total = served
    ? versions.reduce((sum, v) => sum + (served.get(`${model}@${v.version}`) || 0), 0)
    : 0;
  card.tbody.replaceChildren(
    ...versions.map((v) => {
      const count = served?.get(`${model}@${v.version}`) || 0;
      return el(
        "tr",
        { "data-version": v.version, "data-state": v.state },
        el("td", {}, v.version || "—"),
        el("td", {}, el("span", { class: `badge ${stateKind(v.state)}` }, v.state)),
        el("td", {}, v.circuit_breaker || "—"),
        ...(served
          ? [
              el("td", { class: "num" }, fmtCount(count)),
              el("td", { class: "num" }, total ? fmtPercent(count / total) : "—"),
            ]
          : []),
        el("td", { class: "reason" }, v.reason || ""),
      );
    }),
  );
  if (card.traffic) {
    const ready = versions.filter((v) => v.state === "ready" && v.version).map((v) => v.version);
    if (ready.join() !== card.versions) {
      card.versions = ready.join();
      card.traffic.replaceChildren(
        ...ready.map((version) =>
          el(
            "label",
            { class: "weight" },
            `v${version} `,
            el("input", {
              type: "number",
              min: 0,
              step: 1,
              "data-weight": version,
              placeholder: "0",
            }),
          ),
        ),
      );
    }
  }
}

function stateKind(state) {
  return { ready: "good", loading: "warn", unloading: "warn", unavailable: "bad" }[state] || "";
}

/** The management actions of one model: reload, unload, traffic weights. */
function actions(model, card) {
  card.traffic = el("span", { class: "weights" });
  const setWeights = el("p", { class: "muted", "data-weights-set": "" });
  const unload = el("button", { type: "button", class: "danger" }, "Unload");
  unload.addEventListener("click", () => {
    // Two clicks: the first arms it for a few seconds.
    if (unload.dataset.armed) {
      act(`unload ${model}`, () => apiPost(`/v1/repository/models/${model}/unload`));
    } else {
      unload.dataset.armed = "true";
      unload.textContent = "Click again to unload";
      setTimeout(() => {
        delete unload.dataset.armed;
        unload.textContent = "Unload";
      }, 4000);
    }
  });
  const apply = el("button", { type: "button" }, "Set traffic");
  apply.addEventListener("click", () => {
    const weights = {};
    for (const input of card.traffic.querySelectorAll("input[data-weight]")) {
      if (input.value.trim() !== "") weights[input.dataset.weight] = Number(input.value);
    }
    act(`traffic ${model}`, async () => {
      const answer = await apiJson(`/v1/repository/models/${model}/traffic`, {
        method: "PUT",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ weights }),
      });
      setWeights.textContent = `weights set from here: ${Object.entries(answer.weights)
        .map(([v, w]) => `v${v} ${w}`)
        .join(", ")}`;
      return answer;
    });
  });
  return el(
    "div",
    { class: "actions" },
    el(
      "div",
      { class: "buttons" },
      el(
        "button",
        {
          type: "button",
          class: "primary",
          onclick: () =>
            act(`reload ${model}`, () => apiPost(`/v1/repository/models/${model}/reload`)),
        },
        "Reload",
      ),
      unload,
    ),
    el("div", { class: "traffic" }, el("span", {}, "traffic weights "), card.traffic, apply),
    setWeights,
  );
}

function addLoadForm() {
  const input = el("input", {
    type: "text",
    placeholder: "model name",
    id: "models-load-name",
    spellcheck: "false",
  });
  const button = el("button", { type: "button" }, "Load");
  button.addEventListener("click", () => {
    const name = input.value.trim();
    if (name) act(`load ${name}`, () => apiPost(`/v1/repository/models/${name}/load`));
  });
  $("models-refresh").after(el("span", { class: "load" }, input, button));
}

async function apiPost(path) {
  return apiJson(path, { method: "POST" });
}

/** Run one management action: the page says what runs, then what came of it, then refreshes. */
async function act(what, action) {
  if (busy) return;
  busy = true;
  clearTimeout(timer);
  for (const button of document.querySelectorAll("#page-models button")) button.disabled = true;
  status(`${what}: running…`);
  try {
    const answer = await action();
    const rows = answer.versions?.map((v) => `v${v.version} ${v.state}`).join(", ");
    status(`${what}: done${rows ? ` (${rows})` : ""}`);
  } catch (error) {
    status(`${what}: ${error.message}`, true);
  } finally {
    busy = false;
    for (const button of document.querySelectorAll("#page-models button")) button.disabled = false;
    refresh();
  }
}

function status(message, isError = false) {
  const line = $("models-status");
  line.textContent = message;
  line.classList.toggle("error", isError);
}
