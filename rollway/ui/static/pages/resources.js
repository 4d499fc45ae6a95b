// @ts-check
// Resources (/ui/resources): the versioned resource bundles (prompts, model names, anything rollouts run with),
// in the admin API's order, a page at a time, the latest marked; each version's content on demand.

import { api } from "../api.js";
import { clear, failure, h, json, link, time } from "../dom.js";

/** @import { Page, ResourcesUpdate } from "../api.js" */

const LIMIT = 50;

/**
 * @param {HTMLElement} main
 * @param {string[]} _params  none
 * @param {AbortSignal} signal
 * @returns {Promise<void>}
 */
export async function render(main, _params, signal) {
  const cursor = new URL(location.href).searchParams.get("cursor");
  const box = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  main.append(h("h1", {}, "Resources"), box);
  /** @type {Page<ResourcesUpdate>} */
  let page;
  /** @type {ResourcesUpdate | null} */
  let latest = null;
  try {
    page = /** @type {Page<ResourcesUpdate>} */ (await api("/resources", { query: { limit: LIMIT, cursor }, signal }));
    if (page.items.length) latest = /** @type {ResourcesUpdate} */ (await api("/resources/latest", { signal })); // exists once any bundle does
  } catch (error) {
    if (/** @type {Error} */ (error).name !== "AbortError") clear(box, failure(error));
    return;
  }
  if (!page.items.length) {
    clear(box, h("p", { class: "muted" }, "No resources yet."));
    return;
  }
  clear(
    box,
    h(
      "table",
      { class: "grid", id: "resources-table" },
      h("thead", {}, h("tr", {}, ["resources", "version", "created", "updated", "content"].map((c) => h("th", {}, c)))),
      h(
        "tbody",
        {},
        page.items.map((r) =>
          h(
            "tr",
            { dataset: { resourcesId: r.resources_id, version: r.version } },
            h("td", {}, r.resources_id, latest && latest.resources_id === r.resources_id && latest.version === r.version ? h("span", { class: "badge status-active" }, "latest") : null),
            h("td", { class: "num" }, r.version),
            h("td", {}, time(r.create_time)),
            h("td", {}, time(r.update_time)),
            h("td", {}, h("details", {}, h("summary", {}, Object.keys(r.resources).join(", ") || "(empty)"), json(r.resources))),
          ),
        ),
      ),
    ),
    page.next_cursor ? h("nav", { class: "pager" }, link(`/ui/resources?cursor=${encodeURIComponent(page.next_cursor)}`, "next →")) : null,
  );
  main.dataset.loaded = "true";
}
