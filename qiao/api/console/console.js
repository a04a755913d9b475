// The console's entry: the pages behind the #hash, and the key state in the header.

import { credential, forgetKey, onKeyChange, storedKey } from "./api.js";
import * as dashboard from "./dashboard.js";
import { $ } from "./dom.js";
import * as models from "./models.js";
import * as playground from "./playground.js";

const listener = document.body.dataset.listener;
const pages = listener === "management" ? { models } : { playground, dashboard, models };
const allPages = ["playground", "dashboard", "models"];

function route() {
  const wanted = location.hash.slice(1) || Object.keys(pages)[0];
  const name = allPages.includes(wanted) ? wanted : Object.keys(pages)[0];
  for (const page of allPages) {
    $(`page-${page}`).hidden = page !== name || !(page in pages);
    const link = document.querySelector(`#nav a[data-page="${page}"]`);
    link.classList.toggle("on", page === name);
    link.hidden = !(page in pages);
  }
  $("page-elsewhere").hidden = name in pages;
  for (const [page, module] of Object.entries(pages)) {
    if (page === name) module.show();
    else module.hide();
  }
}

function showKeyState() {
  const key = storedKey();
  $("auth-state").textContent = key ? `${credential.title} given` : "";
  $("auth-forget").hidden = !key;
}

$("listener-name").textContent = listener === "management" ? "management listener" : "";
$("auth-forget").textContent = listener === "management" ? "Forget token" : "Forget key";
$("auth-forget").addEventListener("click", () => {
  forgetKey();
  location.reload();
});
onKeyChange(showKeyState);
showKeyState();
window.addEventListener("hashchange", route);
route();
