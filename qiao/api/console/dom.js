// Small DOM and number-formatting helpers. Text always goes in as text nodes, never as HTML.

/** el("td", {class: "num", title: "..."}, "text", childNode, ...) */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value === true) node.setAttribute(name, "");
    else node.setAttribute(name, String(value));
  }
  node.append(...children.flat().filter((c) => c !== null && c !== undefined));
  return node;
}

export function $(id) {
  return document.getElementById(id);
}

/** A number of the rate kind: one decimal below 10, none above. */
export function fmtRate(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "—";
  return value < 10 ? value.toFixed(1) : Math.round(value).toLocaleString("en");
}

export function fmtCount(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "—";
  return Math.round(value).toLocaleString("en");
}

/** Seconds as ms below one second, as s above. */
export function fmtSeconds(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "—";
  if (value < 0.01) return `${(value * 1000).toFixed(1)} ms`;
  if (value < 1) return `${Math.round(value * 1000)} ms`;
  return `${value.toFixed(2)} s`;
}

export function fmtPercent(share) {
  if (share === null || share === undefined || !Number.isFinite(share)) return "—";
  return `${(share * 100).toFixed(share < 0.1 ? 1 : 0)} %`;
}

export function fmtTime(date) {
  return date.toLocaleTimeString("en-GB", { hour12: false });
}

/** Whitespace made visible, for showing single tokens. */
export function visibleToken(text) {
  return text.replaceAll(" ", "␣").replaceAll("\n", "↵").replaceAll("\t", "⇥") || "∅";
}
