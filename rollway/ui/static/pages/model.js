// @ts-check
// One model alias (/ui/models/{alias}): its backends, version, paused or active (or held by a weight update),
// calls in flight (and those still on an earlier configuration), its latest weight updates (who, when, from and
// to which version, how long calls were held, how they ended), and the actions pause, resume and swap (a new
// version, and optionally new backends), each behind a confirmation. Refreshed every 3 s.

import { api } from "../api.js";
import { badge, clear, confirmAction, duration, every, failure, h, health, number, seg, time } from "../dom.js";

/** @import { BackendView, EngineVersion, ModelView, WeightUpdate } from "../api.js" */

/** @param {WeightUpdate[]} items  newest first */
function updates(items) {
  if (!items.length) return h("p", { class: "muted", id: "updates-none" }, "No weight update yet.");
  return h(
    "table",
    { class: "grid", id: "updates-table" },
    h("thead", {}, h("tr", {}, ["begun", "from → to", "state", "held", "form", "in flight", "by", "engines report", "error"].map((c) => h("th", {}, c)))),
    h(
      "tbody",
      {},
      items.map((u) =>
        h(
          "tr",
          { dataset: { updateId: u.update_id, state: u.state } },
          h("td", {}, time(u.begun_time)),
          h("td", {}, `${u.from_version} → ${u.to_version}`),
          h("td", {}, badge(u.state)),
          h("td", { class: "num" }, u.held_seconds === null ? "—" : duration(u.held_seconds)),
          h("td", {}, u.form),
          h("td", {}, u.in_flight === "abort" ? `aborted ${u.aborted_calls}` : "drained"),
          h("td", {}, u.by + (u.note ? ` (${u.note})` : "")),
          h("td", {}, Object.entries(u.engine_versions).map(([b, v]) => `${b}: ${v ?? "?"}`).join(", ") || "—"),
          h("td", { class: "error" }, u.error ?? ""),
        ),
      ),
    ),
  );
}

/**
 * What the backend's engine reports as its weight version, beside the recorded one.
 * @param {EngineVersion | undefined} seen
 */
function engineVersion(seen) {
  if (!seen) return h("span", { class: "muted", title: "the engine does not report a weight version" }, "—");
  if (seen.state === "match") return h("span", { class: "version-match", dataset: { state: "match" } }, seen.reported);
  if (seen.state === "unset") return h("span", { class: "version-unset", dataset: { state: "unset" }, title: "never given a version since it started" }, `${seen.reported} (not set)`);
  return h("span", { class: "version-mismatch", dataset: { state: "mismatch" }, title: `calls are recorded as ${seen.expected}` }, `${seen.reported} ≠ ${seen.expected}`);
}

/**
 * @param {BackendView[]} items
 * @param {Record<string, EngineVersion>} engines
 */
function backends(items, engines) {
  return h(
    "table",
    { class: "grid", id: "backends-table" },
    h("thead", {}, h("tr", {}, ["backend", "health", "kind", "url", "model", "weight", "max concurrency", "version", "engine version", "api key"].map((c) => h("th", {}, c)))),
    h(
      "tbody",
      {},
      items.map((b) =>
        h(
          "tr",
          { dataset: { backendId: b.backend_id } },
          h("td", {}, b.backend_id),
          h("td", {}, health(b.up)),
          h("td", {}, b.kind === "auto" ? `auto → ${b.detected_kind ?? "not asked yet"}` : b.kind),
          h("td", {}, b.base_url),
          h("td", {}, b.model),
          h("td", { class: "num" }, number(b.weight)),
          h("td", { class: "num" }, b.max_concurrency ?? "—"),
          h("td", {}, b.version ?? "—"),
          h("td", { class: "engine-version" }, engineVersion(engines[b.backend_id])),
          h("td", {}, b.has_api_key ? "set" : "—"),
        ),
      ),
    ),
  );
}

/**
 * @param {HTMLElement} main
 * @param {string[]} params  [the alias]
 * @param {AbortSignal} signal
 * @returns {Promise<() => void>}
 */
export async function render(main, [alias], signal) {
  const path = `/models/${alias.split("/").map(seg).join("/")}`;
  const head = h("div", {});
  const body = h("div", {});
  const message = h("p", { id: "action-result", role: "status" });
  /**
   * @param {string} verb  what was done, for the message
   * @param {string} text  the confirmation's question
   * @param {() => Promise<unknown>} request  the action; it answers the alias's new ModelView
   */
  const act = async (verb, text, request) => {
    if (!(await confirmAction(text))) return;
    try {
      const view = /** @type {ModelView} */ (await request());
      clear(message, `${verb}: ${view.alias} is ${view.state.paused ? "paused" : "active"}, version ${view.version}.`);
      await refresh();
    } catch (error) {
      clear(message, failure(error));
    }
  };
  const pause = h("button", { type: "button", id: "pause" }, "Pause");
  const resume = h("button", { type: "button", id: "resume" }, "Resume");
  pause.addEventListener("click", () => act("paused", `Pause ${alias}? New calls wait until it is resumed; calls in flight go on.`, () => api(`${path}/pause`, { method: "POST" })));
  resume.addEventListener("click", () => act("resumed", `Resume ${alias}? Waiting calls go on.`, () => api(`${path}/resume`, { method: "POST" })));
  const swapForm = h(
    "form",
    { id: "swap-form", class: "swap" },
    h("h2", {}, "Swap"),
    h("p", { class: "muted" }, "New calls use the new configuration at once; calls in flight finish where they started."),
    h("label", {}, "new version ", h("input", { name: "version", required: true, size: 16 })),
    h("label", {}, "backends (JSON list, empty: keep the current ones)", h("textarea", { name: "backends", rows: 3, cols: 60, placeholder: '[{"base_url": "http://…", "model": "…"}]' })),
    h("label", {}, "drain timeout (s, optional) ", h("input", { name: "drain", type: "number", min: 0, max: 600, step: "any", size: 6 })),
    h("button", { type: "submit" }, "Swap…"),
  );
  swapForm.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = new FormData(swapForm);
    /** @type {{ version: string, backends?: unknown[], drain_timeout_seconds?: number }} */
    const body = { version: String(data.get("version")).trim() };
    const raw = String(data.get("backends") ?? "").trim();
    try {
      if (raw) body.backends = JSON.parse(raw);
    } catch (error) {
      clear(message, failure(new Error(`backends: not JSON (${/** @type {SyntaxError} */ (error).message})`)));
      return;
    }
    const drain = String(data.get("drain") ?? "").trim();
    if (drain) body.drain_timeout_seconds = Number(drain);
    act("swapped", `Swap ${alias} to version ${body.version}${body.backends ? ` with ${body.backends.length} new backend(s)` : ""}?`, () => api(`${path}/swap`, { method: "POST", body }));
  });
  main.append(h("h1", {}, "Model ", h("code", {}, alias)), head, h("div", { class: "bar" }, pause, resume), message, body, swapForm);

  const refresh = async () => {
    /** @type {ModelView} */
    let view;
    /** @type {WeightUpdate[]} */
    let recent;
    try {
      view = /** @type {ModelView} */ (await api(path, { signal }));
      recent = /** @type {{ items: WeightUpdate[] }} */ (await api(`${path}/updates`, { query: { limit: 10 }, signal })).items;
    } catch (error) {
      if (/** @type {Error} */ (error).name !== "AbortError") clear(head, failure(error));
      return;
    }
    const paused = view.state.paused;
    pause.disabled = paused;
    resume.disabled = !paused;
    clear(
      head,
      h(
        "dl",
        { class: "facts", id: "model-state", dataset: { paused: String(paused) } },
        h("dt", {}, "state"),
        h(
          "dd",
          {},
          badge(view.state.updating ? "updating" : paused ? "paused" : "active"),
          view.state.in_flight_old ? h("span", {}, " ", badge("draining")) : null,
        ),
        h("dt", {}, "version"),
        h("dd", { id: "model-version" }, view.version),
        h("dt", {}, "calls in flight"),
        h("dd", { id: "in-flight" }, `${number(view.state.in_flight)} (${number(view.state.in_flight_old)} on an earlier configuration)`),
        h("dt", {}, "completions here"),
        h("dd", { id: "capture" }, `${number(view.capture.completions)}, ${number(view.capture.untrainable)} without token ids, ${number(view.capture.without_logprobs)} with ids but not a logprob for every token`),
        h("dt", {}, "sampling"),
        h("dd", {}, view.sampling ? JSON.stringify(view.sampling) : "—"),
      ),
    );
    clear(body, h("h2", {}, "Backends"), backends(view.backends, view.engine_versions ?? {}), h("h2", {}, "Weight updates"), updates(recent));
    main.dataset.loaded = "true";
  };
  return every(3, refresh);
}
