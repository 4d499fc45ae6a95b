// @ts-check
// Models (/ui/models): every model alias, its version, state, calls in flight and backends.

import { api } from "../api.js";
import { clear, every, failure, h } from "../dom.js";
import { modelTable } from "./overview.js";

/** @import { ModelView, Page } from "../api.js" */

/**
 * @param {HTMLElement} main
 * @param {string[]} _params  none
 * @param {AbortSignal} signal
 * @returns {Promise<() => void>}
 */
export async function render(main, _params, signal) {
  const box = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  main.append(h("h1", {}, "Models"), box);
  return every(5, async () => {
    try {
      const page = /** @type {Page<ModelView>} */ (await api("/models", { signal }));
      clear(box, modelTable(page.items));
      main.dataset.loaded = "true";
    } catch (error) {
      if (/** @type {Error} */ (error).name !== "AbortError") clear(box, failure(error));
    }
  });
}
