// @ts-check
// Small helpers to build the pages: elements from data (text is always set as text, never parsed as markup),
// formats for times, durations and numbers, and a confirmation dialog.

const SVG = "http://www.w3.org/2000/svg";

/**
 * An attribute's value: set as text; true sets it empty, and null, undefined and false leave it out.
 * @typedef {string | number | boolean | null | undefined} Attribute
 */
/**
 * An element's attributes by name; `class` is a string, `dataset` an object of data-* values, `on<event>` a listener.
 * @typedef {Record<string, Attribute | EventListener | Record<string, Attribute>>} Props
 */
/**
 * What goes inside an element: nodes, text (a number or true as its text), arrays of them nested to any depth;
 * null, undefined and false are left out. The array is spelled as its index and length because a JSDoc type
 * may refer to itself only inside an object type.
 * @typedef {Node | string | number | boolean | null | undefined | { readonly [i: number]: Child, readonly length: number }} Child
 */

/**
 * @param {HTMLElement | SVGElement} el
 * @param {Props} props
 */
function put(el, props) {
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.setAttribute("class", /** @type {string} */ (value));
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), /** @type {EventListener} */ (value));
    else if (name === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
}

/**
 * @param {Element} el
 * @param {Child[]} children
 */
function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
}

// An HTML element: h("a", {href: "/ui"}, "text", child, [more]).
/**
 * @template {keyof HTMLElementTagNameMap} K
 * @param {K} tag
 * @param {Props} props
 * @param {...Child} children
 * @returns {HTMLElementTagNameMap[K]}  an HTMLInputElement for "input", and so on
 */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  put(el, props);
  append(el, children);
  return el;
}

// An SVG element, as h.
/**
 * @template {keyof SVGElementTagNameMap} K
 * @param {K} tag
 * @param {Props} props
 * @param {...Child} children
 * @returns {SVGElementTagNameMap[K]}
 */
export function s(tag, props, ...children) {
  const el = document.createElementNS(SVG, tag);
  put(el, props);
  append(el, children);
  return el;
}

// Replaces what `el` holds with `children`; answers `el`.
/**
 * @template {Element} E
 * @param {E} el
 * @param {...Child} children
 * @returns {E}
 */
export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

const pad = (/** @type {number} */ n) => String(n).padStart(2, "0");

// Local time, to the second: 2026-11-28 05:40:12.
/** @param {number | null | undefined} seconds  since the epoch; "—" for none */
export function time(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const d = new Date(seconds * 1000);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

// Local time of day, to the minute: 05:40.
/** @param {number} seconds  since the epoch */
export function clock(seconds) {
  const d = new Date(seconds * 1000);
  return `${pad(d.getHours())}:${pad(d.getMinutes())}`;
}

/** @param {number | null | undefined} seconds  "—" for none */
export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(2)} s`;
  if (seconds < 7200) return `${(seconds / 60).toFixed(1)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

/**
 * @param {number | null | undefined} value  "—" for none
 * @param {number} [digits]  the most fraction digits shown of a value that is not an integer
 */
export function number(value, digits = 2) {
  if (value === null || value === undefined) return "—";
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  return Number(value.toFixed(digits)).toLocaleString("en-US", { maximumFractionDigits: digits });
}

// A recorded value (a span's attribute, a part of its request or answer) as text: a string as it is, anything
// else as JSON. Spans come from agents, tracers and OTLP exporters too: their values may have any type.
/** @param {unknown} value */
export function shown(value) {
  if (typeof value === "string") return value;
  try {
    return JSON.stringify(value) ?? String(value);
  } catch {
    return String(value);
  }
}

// A recorded value that does not have the type its field holds: shown as its text, marked, never used as that
// type (a string where a number belongs is not formatted, nor a number where a list belongs iterated).
/** @param {unknown} value */
export function malformed(value) {
  return h("span", { class: "malformed", title: "not of the type this field holds: shown as it was recorded" }, shown(value));
}

// A recorded number: formatted as `number` formats it; "—" (or `none`) when absent; marked when not a number.
/**
 * @param {unknown} value
 * @param {number} [digits]
 * @param {string} [none]
 * @returns {string | HTMLElement}
 */
export function recordedNumber(value, digits = 2, none = "—") {
  if (value === null || value === undefined) return none;
  return typeof value === "number" && Number.isFinite(value) ? number(value, digits) : malformed(value);
}

// A recorded duration in seconds: formatted as `duration` formats it; "—" when absent; marked when not a number.
/**
 * @param {unknown} value
 * @returns {string | HTMLElement}
 */
export function recordedDuration(value) {
  if (value === null || value === undefined) return "—";
  return typeof value === "number" && Number.isFinite(value) ? duration(value) : malformed(value);
}

// A recorded text: as it is; `none` when absent; marked when not a string.
/**
 * @param {unknown} value
 * @param {string} [none]
 * @returns {string | HTMLElement}
 */
export function recordedText(value, none = "") {
  if (value === null || value === undefined) return none;
  return typeof value === "string" ? value : malformed(value);
}

/** @param {string} status */
export function badge(status) {
  return h("span", { class: `badge status-${status}`, dataset: { status } }, status);
}

// A backend's health as the gateway sees it: up, down (ejected after failures) or unknown.
/** @param {boolean | null | undefined} up */
export function health(up) {
  const state = up === true ? "up" : up === false ? "down" : "unknown";
  return h("span", { class: `badge health-${state}`, dataset: { health: state } }, state);
}

// A link to another page of the dashboard (the app draws it without reloading).
/**
 * @param {string} href
 * @param {...Child} children
 */
export function link(href, ...children) {
  return h("a", { href }, ...children);
}

// One path segment of a URL, `value` percent-encoded.
/** @param {string} value */
export function seg(value) {
  return encodeURIComponent(value);
}

// What went wrong, as a paragraph: the error's message, or whatever was thrown as text.
/** @param {unknown} error */
export function failure(error) {
  const thrown = /** @type {{ message?: string } | null | undefined} */ (error);
  return h("p", { class: "error", role: "alert" }, thrown && thrown.message ? thrown.message : String(error));
}

// JSON shown as text, indented.
/** @param {unknown} value */
export function json(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

// Ask before acting: resolves true when the user confirms.
/**
 * @param {string} text  the question
 * @returns {Promise<boolean>}
 */
export function confirmAction(text) {
  const dialog = /** @type {HTMLDialogElement} */ (document.getElementById("confirm-dialog"));
  /** @type {HTMLElement} */ (document.getElementById("confirm-text")).textContent = text;
  return new Promise((resolve) => {
    const ok = /** @type {HTMLButtonElement} */ (document.getElementById("confirm-ok"));
    const cancel = /** @type {HTMLButtonElement} */ (document.getElementById("confirm-cancel"));
    const finish = (/** @type {boolean} */ answer) => (/** @type {Event} */ event) => {
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
/**
 * @param {number} seconds
 * @param {() => Promise<void>} task  a failure other than an abort is logged, and the next run comes all the same
 * @returns {() => void}
 */
export function every(seconds, task) {
  /** @type {number | undefined} */
  let timer = undefined;
  let stopped = false;
  const run = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try {
        await task();
      } catch (error) {
        const failed = /** @type {Error} */ (error);
        if (failed.name !== "AbortError") console.warn("refresh failed:", failed.message);
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
