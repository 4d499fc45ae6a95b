// Small helpers to build the pages: elements from data (text is always set as text, never parsed as markup),
// formats for times, durations and numbers, and a confirmation dialog.

const SVG = "http://www.w3.org/2000/svg";

function put(el, props) {
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.setAttribute("class", value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

// An HTML element: h("a", {href: "/ui"}, "text", child, [more]).
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  put(el, props);
  append(el, children);
  return el;
}

// An SVG element, as h.
export function s(tag, props, ...children) {
  const el = document.createElementNS(SVG, tag);
  put(el, props);
  append(el, children);
  return el;
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

const pad = (n) => String(n).padStart(2, "0");

// Local time, to the second: 2026-11-28 05:40:12.
export function time(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const d = new Date(seconds * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function clock(seconds) {
  const d = new Date(seconds * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(2)} s`;
  if (seconds < 7200) return `${(seconds / 60).toFixed(1)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

export function number(value, digits = 2) {
  if (value === null || value === undefined) return "—";
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  return Number(value.toFixed(digits)).toLocaleString("en-US", { maximumFractionDigits: digits });
}

export function badge(status) {
  return h("span", { class: `badge status-${status}`, dataset: { status } }, status);
}

// A backend's health as the gateway sees it: up, down (ejected after failures) or unknown.
export function health(up) {
  const state = up === true ? "up" : up === false ? "down" : "unknown";
  return h("span", { class: `badge health-${state}`, dataset: { health: state } }, state);
}

// A link to another page of the dashboard (the app draws it without reloading).
export function link(href, ...children) {
  return h("a", { href }, ...children);
}

export function seg(value) {
  return encodeURIComponent(value);
}

export function failure(error) {
  return h("p", { class: "error", role: "alert" }, error && error.message ? error.message : String(error));
}

// JSON shown as text, indented.
export function json(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

// Ask before acting: resolves true when the user confirms.
export function confirmAction(text) {
  const dialog = document.getElementById("confirm-dialog");
  document.getElementById("confirm-text").textContent = text;
  return new Promise((resolve) => {
    const ok = document.getElementById("confirm-ok");
    const cancel = document.getElementById("confirm-cancel");
    const finish = (answer) => (event) => {
      event.preventDefault();
      ok.onclick = cancel.onclick = dialog.oncancel = null;
      dialog.close();
      resolve(answer);
    };
    ok.onclick = finish(true);
    cancel.onclick = finish(false);
    dialog.oncancel = finish(false);
    dialog.showModal();
  });
}

// Calls `task` now and every `seconds` while the page is shown and the tab visible; the returned function stops.
export function every(seconds, task) {
  let timer = null;
  let stopped = false;
  const run = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try {
        await task();
      } catch (error) {
        if (error.name !== "AbortError") console.warn("refresh failed:", error.message);
      }
    }
    if (!stopped) timer = setTimeout(run, seconds * 1000);
  };
  run();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
