// @ts-check
// Rollouts (/ui/rollouts): newest first (or oldest first), filtered by status, mode, group and the model alias
// they called, a page at a time (the admin API's cursor), found by id, and refreshed every 5 s while "live" is on.
// The filters, the order, the page size and the cursor are in the page's URL
// (?status=&mode=&group=&model=&order=&limit=&cursor=), so every view of the list can be shared.

import { ApiError, api } from "../api.js";
import { go } from "../app.js";
import { badge, clear, duration, every, failure, h, link, number, seg, time } from "../dom.js";

/** @import { ModelView, Page, Rollout } from "../api.js" */

const STATUSES = ["queuing", "requeuing", "preparing", "running", "succeeded", "failed", "cancelled"];
const MODES = ["train", "val", "test"];
const LIMIT = 50;
// The admin API's `order` values and their labels; the first is the default, left out of the page's URL.
/** @type {[string, string][]} */
const ORDERS = [
  ["desc", "newest first"],
  ["asc", "oldest first"],
];

/**
 * @param {string} name  the form field's name
 * @param {string} label
 * @param {string[]} options  besides "any" (the empty value)
 * @param {string} value  the one selected
 */
function select(name, label, options, value) {
  return h(
    "label",
    {},
    label,
    " ",
    h("select", { name }, h("option", { value: "" }, "any"), options.map((o) => h("option", { value: o, selected: o === value }, o))),
  );
}

/** @param {Rollout} r */
function row(r) {
  const took = r.end_time ? r.end_time - r.start_time : null;
  return h(
    "tr",
    { dataset: { rolloutId: r.rollout_id } },
    h("td", {}, link(`/ui/rollouts/${seg(r.rollout_id)}`, r.rollout_id)),
    h("td", {}, badge(r.status)),
    h("td", { class: "num reward" }, r.reward === null || r.reward === undefined ? "—" : number(r.reward, 4)),
    h("td", {}, r.mode ?? "—"),
    h("td", {}, r.group_id ? link(`/ui/groups/${seg(r.group_id)}`, r.group_id) : "—", r.group_id ? ` #${r.group_index ?? ""}` : ""),
    h("td", { class: "num" }, number(r.attempt_count)),
    h("td", {}, time(r.start_time)),
    h("td", { class: "num" }, duration(took)),
  );
}

/** @param {Rollout[]} items */
function table(items) {
  if (!items.length) return h("p", { class: "muted", id: "no-rollouts" }, "No rollout matches.");
  return h(
    "table",
    { class: "grid", id: "rollouts-table" },
    h("thead", {}, h("tr", {}, ["rollout", "status", "reward", "mode", "group", "attempts", "started", "took"].map((c) => h("th", {}, c)))),
    h("tbody", {}, items.map(row)),
  );
}

/**
 * @param {HTMLElement} main
 * @param {string[]} _params  none
 * @param {AbortSignal} signal
 * @returns {Promise<() => void>}
 */
export async function render(main, _params, signal) {
  const url = new URL(location.href);
  /** @type {Record<string, string>} the form's fields by name (the admin API calls `group` group_id) */
  const filters = {
    status: url.searchParams.get("status") ?? "",
    mode: url.searchParams.get("mode") ?? "",
    group: url.searchParams.get("group") ?? "",
    model: url.searchParams.get("model") ?? "",
  };
  const asked = url.searchParams.get("order");
  // An unknown value: the default (`asked` is one of ORDERS' values where it is taken, so not null).
  let order = ORDERS.some(([value]) => value === asked) ? /** @type {string} */ (asked) : ORDERS[0][0];
  const cursor = url.searchParams.get("cursor");
  const limit = Math.min(1000, Math.max(1, Number(url.searchParams.get("limit")) || LIMIT));
  const back = url.searchParams.getAll("back"); // the cursors of the pages before this one, for "previous"
  const form = h(
    "form",
    { class: "filters", id: "rollout-filters" },
    select("status", "status", STATUSES, filters.status),
    select("mode", "mode", MODES, filters.mode),
    h("label", {}, "group ", h("input", { name: "group", value: filters.group, placeholder: "group id", size: 18 })),
    h("label", {}, "model ", h("input", { name: "model", value: filters.model, placeholder: "alias", size: 14, list: "model-aliases" })),
    h("datalist", { id: "model-aliases" }),
    h("label", {}, "order ", h("select", { name: "order" }, ORDERS.map(([value, text]) => h("option", { value, selected: value === order }, text)))),
    h("button", { type: "submit" }, "Filter"),
  );
  const search = h(
    "form",
    { class: "filters", id: "rollout-search" },
    h("label", {}, "rollout id ", h("input", { name: "id", placeholder: "go to a rollout", size: 24, required: true })),
    h("button", { type: "submit" }, "Open"),
  );
  const note = h("span", { class: "muted", id: "refreshed" });
  const live = h("input", { type: "checkbox", id: "live", checked: true });
  const body = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  const pager = h("nav", { class: "pager" });
  main.append(h("h1", {}, "Rollouts"), h("div", { class: "bar" }, form, search), h("div", { class: "bar" }, h("label", {}, live, " live"), note), body, pager);

  // The list's URL with the filters and order shown, and `next`: the page to go to (null: the first).
  /** @param {{ back: string[], cursor: string | null } | null} next */
  const params = (next) => {
    const out = new URLSearchParams();
    for (const [name, value] of Object.entries(filters)) if (value) out.set(name, value);
    if (order !== ORDERS[0][0]) out.set("order", order);
    if (limit !== LIMIT) out.set("limit", String(limit));
    if (next) {
      for (const c of next.back) out.append("back", c);
      if (next.cursor) out.set("cursor", next.cursor);
    }
    const text = out.toString();
    return `/ui/rollouts${text ? "?" + text : ""}`;
  };
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = new FormData(form);
    for (const name of Object.keys(filters)) filters[name] = String(data.get(name) ?? "").trim();
    order = String(data.get("order") ?? ORDERS[0][0]);
    go(params(null));
  });
  search.addEventListener("submit", async (event) => {
    event.preventDefault();
    const id = String(new FormData(search).get("id") ?? "").trim();
    if (!id) return;
    try {
      await api(`/rollouts/${seg(id)}`, { signal });
      go(`/ui/rollouts/${seg(id)}`);
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) clear(note, h("span", { class: "error" }, `No rollout '${id}'.`));
      else clear(note, failure(error));
    }
  });

  const refresh = async () => {
    if (main.dataset.loaded && !live.checked) return;
    const query = { limit, cursor, order, mode: filters.mode, group_id: filters.group, status: filters.status, model: filters.model };
    /** @type {Page<Rollout>} */
    let page;
    try {
      page = /** @type {Page<Rollout>} */ (await api("/rollouts", { query, signal }));
    } catch (error) {
      if (/** @type {Error} */ (error).name !== "AbortError") clear(body, failure(error));
      return;
    }
    if (signal.aborted) return;
    clear(body, table(page.items));
    const previous = back.length ? back[back.length - 1] : null;
    clear(
      pager,
      cursor ? link(params({ back: back.slice(0, -1), cursor: previous === "" ? null : previous }), "← previous") : null,
      " ",
      page.next_cursor ? link(params({ back: [...back, cursor ?? ""], cursor: page.next_cursor }), "next →") : null,
    );
    note.textContent = `updated ${new Date().toLocaleTimeString()}`;
    main.dataset.loaded = "true";
  };
  api("/models", { signal })
    .then((page) => {
      const aliases = /** @type {HTMLDataListElement} */ (form.querySelector("#model-aliases"));
      aliases.append(.../** @type {Page<ModelView>} */ (page).items.map((m) => h("option", { value: m.alias })));
    })
    .catch(() => {}); // the suggestions are optional
  return every(5, refresh);
}
