// @ts-check
// Token views. A response's tokens are coloured by probability (exp(logprob)): red for unlikely, green for
// likely; hovering one shows its id and logprob, clicking pins them below the view, and "ids" shows every
// token as its id. A merged training sequence is coloured by its loss mask instead. Long sequences are drawn
// CHUNK tokens at a time, on demand.

import { h, malformed, shown } from "./dom.js";

const CHUNK = 1000;

/** @param {unknown} logprob */
function shade(logprob) {
  if (typeof logprob !== "number") return "";
  const p = Math.exp(logprob);
  return `p${Math.min(9, Math.floor(p * 10))}`; // ten classes: p0 (< 0.1) … p9 (≥ 0.9)
}

// Draws `count` items into `container` CHUNK at a time, `draw(i)` each, behind a "show more" button.
/**
 * @param {HTMLElement} container
 * @param {number} count
 * @param {(i: number) => Node} draw
 */
function chunked(container, count, draw) {
  let shown = 0;
  const more = h("button", { type: "button", class: "more" });
  const step = () => {
    const end = Math.min(count, shown + CHUNK);
    const part = document.createDocumentFragment();
    for (let i = shown; i < end; i++) part.append(draw(i));
    more.before(part);
    shown = end;
    more.hidden = shown >= count;
    more.textContent = `show ${Math.min(CHUNK, count - shown)} more of ${count - shown}`;
  };
  more.addEventListener("click", step);
  container.append(more);
  step();
}

// ids: token ids; logprobs: aligned logprobs or null; texts: aligned token strings or null. Both lists are a
// span's, whose types are not trusted: a token whose id is not an integer, or whose logprob is not a number, is
// shown with the value as it was recorded and marked `malformed` (uncoloured); logprobs that are not a list are
// said to be so in the legend.
/**
 * @param {unknown[]} ids
 * @param {unknown} logprobs
 * @param {(string | null)[] | null} texts
 * @returns {HTMLElement}
 */
export function tokenView(ids, logprobs, texts) {
  const detail = h("div", { class: "token-detail muted" }, "Hover or click a token for its id and logprob.");
  const view = h("div", { class: "tokens" });
  const box = h("div", { class: "token-view" });
  const idsToggle = h("input", { type: "checkbox", class: "show-ids" });
  idsToggle.addEventListener("change", () => box.classList.toggle("ids", idsToggle.checked));
  const aligned = Array.isArray(logprobs) ? logprobs : null;
  const marked = ids.some((id) => !Number.isInteger(id)) || Boolean(aligned?.some(wrongLogprob));
  chunked(view, ids.length, (i) => {
    const id = ids[i];
    const goodId = Number.isInteger(id);
    const given = aligned ? aligned[i] : null;
    const badLp = wrongLogprob(given);
    const lp = typeof given === "number" && !badLp ? given : null;
    // A wrong value is quoted as JSON in the label: a string "-0.2" is told apart from the number -0.2.
    let label = `#${i} id ${goodId ? id : `${quoted(id)} (not an integer)`}`;
    if (lp !== null) label += ` · logprob ${lp.toFixed(4)} · p ${Math.exp(lp).toFixed(3)}`;
    else if (badLp) label += ` · logprob ${quoted(given)} (not a number)`;
    const text = texts ? texts[i] : null;
    const bad = !goodId || badLp;
    return h(
      "span",
      { class: `tok ${shade(lp)}${bad ? " malformed" : ""}`, title: label, dataset: { id: shown(id), logprob: lp ?? (badLp ? shown(given) : ""), i } },
      h("span", { class: "t" }, typeof text === "string" ? text : shown(id)),
      h("span", { class: "i" }, shown(id)),
    );
  });
  view.addEventListener("click", (event) => {
    const tok = /** @type {HTMLElement | null} */ (/** @type {Element} */ (event.target).closest(".tok"));
    if (tok) detail.textContent = tok.title;
  });
  box.append(h("label", { class: "muted" }, idsToggle, " ids"), legend(logprobs, marked), view, detail);
  return box;
}

/** @param {unknown} value */
function quoted(value) {
  return JSON.stringify(value) ?? String(value);
}

// Whether a recorded logprob is there but not a number (none, null, is no logprob: the token is uncoloured).
/** @param {unknown} lp */
function wrongLogprob(lp) {
  return lp !== null && lp !== undefined && !(typeof lp === "number" && Number.isFinite(lp));
}

// What the colours mean: the probability of each token (exp(logprob)), in tenths; or that there is none; and
// what a marked token is, when there is one (`marked`).
/**
 * @param {unknown} logprobs
 * @param {boolean} marked
 */
function legend(logprobs, marked) {
  const key = h("div", { class: "token-legend muted" }, "p = exp(logprob): ");
  if (logprobs === null || logprobs === undefined) {
    key.append("no logprobs were recorded for this call (its tokens are uncoloured).");
  } else if (!Array.isArray(logprobs)) {
    key.append("the recorded logprobs are not a list (its tokens are uncoloured): ", malformed(logprobs));
  } else {
    for (let k = 0; k < 10; k++) {
      const range = k === 0 ? "< 0.1" : k === 9 ? "≥ 0.9" : `${(k / 10).toFixed(1)}–${((k + 1) / 10).toFixed(1)}`;
      key.append(h("span", { class: `swatch p${k}`, title: `p ${range}` }, range), " ");
    }
    key.append(h("span", { class: "swatch" }, "none"), " (no logprob)");
  }
  if (marked) {
    key.append(" · ", h("span", { class: "swatch malformed" }, "marked"), " (an id or logprob of the wrong type, shown as recorded)");
  }
  return key;
}

// A merged row: every token, those with loss mask 1 (sampled, trained on) marked, the others context.
/**
 * @param {number[]} ids
 * @param {number[]} mask  aligned with `ids`
 * @returns {HTMLElement}
 */
export function maskView(ids, mask) {
  const view = h("div", { class: "tokens masked" });
  chunked(view, ids.length, (i) =>
    h("span", { class: mask[i] ? "tok trained" : "tok context", title: `#${i} id ${ids[i]} · loss mask ${mask[i]}` }, String(ids[i])),
  );
  const key = h(
    "div",
    { class: "token-legend muted" },
    h("span", { class: "swatch trained" }, "trained"),
    " loss mask 1 (sampled, trained on) · ",
    h("span", { class: "swatch context" }, "context"),
    " loss mask 0 (prompt, tool output)",
  );
  return h("div", { class: "token-view ids" }, key, view);
}
