// @ts-check
// Overview (/ui): rollouts by status and the queue depth, the gateway's calls over the last hour as charts,
// the model aliases, their state and their backends up or down. Refreshed every 10 s.

import { api } from "../api.js";
import { lineChart } from "../charts.js";
import { badge, clear, duration, every, failure, h, health, link, number, seg } from "../dom.js";

/** @import { ModelView, Page, SeriesPoint, SeriesView, StatusCounts } from "../api.js" */

const STATUSES = ["queuing", "requeuing", "preparing", "running", "succeeded", "failed", "cancelled"];

/** @param {StatusCounts} view */
function counts(view) {
  const statuses = [...STATUSES, ...Object.keys(view.rollouts_by_status).filter((s) => !STATUSES.includes(s))];
  return h(
    "section",
    { class: "tiles", id: "status-counts" },
    statuses.map((status) =>
      h(
        "a",
        { class: `tile status-${status}`, href: `/ui/rollouts?status=${status}`, dataset: { status } },
        h("span", { class: "count" }, number(view.rollouts_by_status[status] ?? 0)),
        h("span", { class: "label" }, status),
      ),
    ),
    h(
      "div",
      { class: "tile queue", id: "queue-depth" },
      h("span", { class: "count" }, number(view.queue_depth)),
      h("span", { class: "label" }, "queue depth"),
    ),
  );
}

/** @param {SeriesView} view */
function charts(view) {
  const times = view.points.map((p) => p.start);
  const pick = (/** @type {keyof SeriesPoint} */ name) => view.points.map((p) => p[name]);
  const tokens = (/** @type {number} */ v) => (v >= 1000 ? `${number(v / 1000, 1)}k` : number(v, 0));
  return h(
    "section",
    { class: "charts" },
    lineChart({ title: "calls/s", times, series: [{ name: "calls/s", values: pick("calls_per_second") }] }),
    lineChart({
      title: "latency",
      times,
      format: duration,
      series: [
        { name: "mean", values: pick("latency_mean_seconds") },
        { name: "max", values: pick("latency_max_seconds"), cls: "second" },
      ],
    }),
    lineChart({ title: "time to first token", times, format: duration, series: [{ name: "mean", values: pick("ttft_mean_seconds") }] }),
    lineChart({
      title: "tokens per minute",
      times,
      format: tokens,
      series: [
        { name: "prompt", values: pick("input_tokens") },
        { name: "output", values: pick("output_tokens"), cls: "second" },
      ],
    }),
    lineChart({ title: "reward (mean of those recorded)", times, format: (v) => number(v, 3), series: [{ name: "mean", values: pick("reward_mean") }] }),
  );
}

/** @param {ModelView[]} models */
export function modelTable(models) {
  if (!models.length) return h("p", { class: "muted" }, "No model alias yet.");
  return h(
    "table",
    { class: "grid", id: "models-table" },
    h("thead", {}, h("tr", {}, ["alias", "version", "state", "in flight", "backends"].map((c) => h("th", {}, c)))),
    h(
      "tbody",
      {},
      models.map((m) =>
        h(
          "tr",
          { dataset: { alias: m.alias } },
          h("td", {}, link(`/ui/models/${m.alias.split("/").map(seg).join("/")}`, m.alias)),
          h("td", {}, m.version),
          h("td", {}, badge(m.state.paused ? "paused" : "active")),
          h("td", {}, number(m.state.in_flight)),
          h("td", {}, m.backends.map((b) => h("div", { class: "backend", dataset: { backendId: b.backend_id } }, health(b.up), ` ${b.backend_id} · ${b.detected_kind ?? b.kind} · ${b.base_url}`))),
        ),
      ),
    ),
  );
}

/**
 * @param {HTMLElement} main
 * @param {string[]} _params  none
 * @param {AbortSignal} signal
 * @returns {Promise<() => void>}
 */
export async function render(main, _params, signal) {
  const countsBox = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  const chartsBox = h("div", {});
  const modelsBox = h("div", {});
  main.append(
    h("h1", {}, "Overview"),
    h("h2", {}, "Rollouts by status"),
    countsBox,
    h("h2", {}, "Calls over the last hour"),
    chartsBox,
    h("h2", {}, "Models"),
    modelsBox,
  );
  const refresh = async () => {
    const [status, series, models] = await Promise.allSettled([
      /** @type {Promise<StatusCounts>} */ (api("/stats/status", { signal })),
      /** @type {Promise<SeriesView>} */ (api("/stats/series", { query: { window_seconds: 3600, step_seconds: 60 }, signal })),
      /** @type {Promise<Page<ModelView>>} */ (api("/models", { signal })),
    ]);
    if (signal.aborted) return;
    clear(countsBox, status.status === "fulfilled" ? counts(status.value) : failure(status.reason));
    clear(chartsBox, series.status === "fulfilled" ? charts(series.value) : failure(series.reason));
    clear(modelsBox, models.status === "fulfilled" ? modelTable(models.value.items) : failure(models.reason));
    main.dataset.loaded = "true";
  };
  return every(10, refresh);
}
