// @ts-check
// Line charts as inline SVG: one time axis, one or more series, gaps where a value is null.

import { clock, h, number, s } from "./dom.js";

const W = 360;
const H = 140;
const M = { left: 44, right: 8, top: 10, bottom: 20 };

// The top of the axis: a round number (1, 2, 2.5 or 5 times a power of ten) at or above `value`; 1 for none.
/** @param {number} value */
function niceMax(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * power) return step * power;
  return 10 * power;
}

/**
 * One series of a chart; `cls` is a class added to its line, dot and legend (the style sheet colours "second").
 * @typedef {{ name: string, values: (number | null | undefined)[], cls?: string }} Series
 */

// times: bucket start times (s); series: [{name, values, cls}]; format: a value as text for the axis.
/**
 * @param {{ title: string, times: number[], series: Series[], format?: (value: number) => string }} chart
 * @returns {HTMLElement}
 */
export function lineChart({ title, times, series, format = (v) => number(v) }) {
  // The highest value drawn: null and undefined are gaps here too, not NaN (which would put the top at 1).
  const max = niceMax(Math.max(0, ...series.flatMap((one) => one.values.filter((v) => v !== null && v !== undefined))));
  const plotW = W - M.left - M.right;
  const plotH = H - M.top - M.bottom;
  const x = (/** @type {number} */ i) => M.left + (times.length > 1 ? (i / (times.length - 1)) * plotW : plotW / 2);
  const y = (/** @type {number} */ v) => M.top + plotH - (v / max) * plotH;
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": title });
  for (const fraction of [0, 0.5, 1]) {
    const value = max * fraction;
    svg.append(
      s("line", { x1: M.left, x2: W - M.right, y1: y(value), y2: y(value), class: "grid" }),
      s("text", { x: M.left - 4, y: y(value) + 4, class: "axis", "text-anchor": "end" }, format(value)),
    );
  }
  if (times.length) {
    /** @type {[number, string][]} */
    const ends = [[0, "start"], [Math.floor((times.length - 1) / 2), "middle"], [times.length - 1, "end"]];
    for (const [i, anchor] of ends) {
      svg.append(s("text", { x: x(i), y: H - 4, class: "axis", "text-anchor": anchor }, clock(times[i])));
    }
  }
  for (const one of series) {
    let path = "";
    let open = false;
    one.values.forEach((value, i) => {
      if (value === null || value === undefined) {
        open = false;
        return;
      }
      path += `${open ? "L" : "M"}${x(i).toFixed(1)},${y(value).toFixed(1)}`;
      open = true;
    });
    if (path) svg.append(s("path", { d: path, class: `line ${one.cls || ""}` }, s("title", {}, one.name)));
    // A value with no neighbour draws no line: a dot shows it.
    one.values.forEach((value, i) => {
      const alone = (/** @type {number} */ j) => j < 0 || j >= one.values.length || one.values[j] === null || one.values[j] === undefined;
      if (value !== null && value !== undefined && alone(i - 1) && alone(i + 1)) {
        svg.append(s("circle", { cx: x(i), cy: y(value), r: 2.5, class: `dot ${one.cls || ""}` }));
      }
    });
  }
  const last = series.map((one) => {
    const values = one.values.filter((v) => v !== null && v !== undefined);
    const value = values.length ? values[values.length - 1] : null;
    return h("span", { class: `legend ${one.cls || ""}` }, `${one.name}: ${value === null ? "—" : format(value)}`);
  });
  return h("figure", { class: "chart-box", dataset: { chart: title } }, h("figcaption", {}, title, " ", last), svg);
}
