// Every data call the console makes goes through apiFetch: the key kept in this tab's
// sessionStorage goes along as `Authorization: Bearer <key>`; a 401 asks for a key (one dialog,
// however many calls were refused) and the call is tried again with it. No cookie is sent.

const listener = document.body.dataset.listener;

export const credential =
  listener === "management"
    ? {
        storageKey: "qiao.managementToken",
        title: "Management token",
        ask: "The management API needs its token (--management-token).",
      }
    : {
        storageKey: "qiao.apiKey",
        title: "API key",
        ask: "This server needs an API key (one of its --api-key values).",
      };

export class AuthCancelled extends Error {
  constructor() {
    super(`no ${credential.title.toLowerCase()} given`);
  }
}

const listeners = new Set();

/** Call `fn()` whenever the stored key changes (a new one given, or forgotten). */
export function onKeyChange(fn) {
  listeners.add(fn);
}

export function storedKey() {
  return sessionStorage.getItem(credential.storageKey);
}

function setKey(key) {
  if (key) sessionStorage.setItem(credential.storageKey, key);
  else sessionStorage.removeItem(credential.storageKey);
  for (const fn of listeners) fn(key);
}

export function forgetKey() {
  setKey(null);
}

let asking = null; // the open dialog's promise, shared by every call refused meanwhile

/** fetch(path, options) with the stored key; asks for a key on 401 until one works. */
export async function apiFetch(path, options = {}) {
  for (;;) {
    const key = storedKey();
    const headers = new Headers(options.headers || {});
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...options, headers, credentials: "omit" });
    if (response.status !== 401) return response;
    if (storedKey() !== key) continue; // another call got a new key meanwhile
    if (key) setKey(null);
    await askForKey(key !== null);
  }
}

/** apiFetch, then the JSON body; throws an Error with the server's message when not 2xx. */
export async function apiJson(path, options = {}) {
  const response = await apiFetch(path, options);
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

/** The message of an error answer: OpenAI's envelope, KServe's {"error": "..."}, or the status. */
export async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error;
    if (typeof error === "string") return `${response.status}: ${error}`;
    if (error && error.message) return `${response.status}: ${error.message}`;
  } catch {
    // not JSON: the status says enough
  }
  return `${response.status} ${response.statusText || "error"}`;
}

function askForKey(refused) {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  const message = document.getElementById("key-message");
  document.getElementById("key-title").textContent = credential.title;
  message.textContent = refused
    ? `The server refused that ${credential.title.toLowerCase()}. Enter another one.`
    : credential.ask;
  message.classList.toggle("error", refused);
  input.value = "";
  asking = new Promise((resolve, reject) => {
    const done = (key) => {
      form.removeEventListener("submit", submit);
      cancel.removeEventListener("click", cancelled);
      dialog.removeEventListener("cancel", cancelled);
      dialog.close();
      asking = null;
      if (key) {
        setKey(key);
        resolve();
      } else {
        reject(new AuthCancelled());
      }
    };
    const submit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (key) done(key);
    };
    const cancelled = (event) => {
      event.preventDefault();
      done(null);
    };
    const cancel = document.getElementById("key-cancel");
    form.addEventListener("submit", submit);
    cancel.addEventListener("click", cancelled);
    dialog.addEventListener("cancel", cancelled);
  });
  dialog.showModal();
  input.focus();
  return asking;
}

/** The events of a Server-Sent Events answer, each `data:` parsed as JSON, until [DONE]. */
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      // Events end with a blank line; one read may hold several, or half of one.
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}
