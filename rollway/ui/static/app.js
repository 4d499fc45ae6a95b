// @ts-check
// The dashboard's entry point: picks the page from the URL, draws it into <main>, and keeps links inside the
// dashboard from reloading the document (history.pushState). Each page module exports
// `render(main, params, signal)`, which may return a function that stops what it keeps running (polling).

import { forgetToken, showForget } from "./api.js";
import { clear, failure, h } from "./dom.js";

/**
 * What every module in pages/ exports: `render` draws the page into `main` from the path's parts the page's
 * pattern captured; `signal` is aborted when the user leaves the page.
 * @typedef {{ render: (main: HTMLElement, params: string[], signal: AbortSignal) => Promise<(() => void) | void> }} PageModule
 */

/** @type {[RegExp, string, () => Promise<PageModule>][]} the path's pattern, the nav section, the module */
const PAGES = [
  [/^\/ui\/?$/, "overview", () => import("./pages/overview.js")],
  [/^\/ui\/rollouts\/?$/, "rollouts", () => import("./pages/rollouts.js")],
  [/^\/ui\/rollouts\/([^/]+)\/?$/, "rollouts", () => import("./pages/rollout.js")],
  [/^\/ui\/groups\/([^/]+)\/?$/, "rollouts", () => import("./pages/group.js")],
  [/^\/ui\/models\/?$/, "models", () => import("./pages/models.js")],
  [/^\/ui\/models\/(.+?)\/?$/, "models", () => import("./pages/model.js")],
  [/^\/ui\/resources\/?$/, "resources", () => import("./pages/resources.js")],
];

/** @type {(() => void) | null} */
let stop = null;
/** @type {AbortController | null} */
let controller = null;
/** @type {string | null} */
let drawn = null; // the path and query of the page drawn

async function show() {
  drawn = location.pathname + location.search;
  const main = /** @type {HTMLElement} */ (document.getElementById("main"));
  delete main.dataset.loaded; // set again by the page once it has drawn its data (the tests wait for it)
  if (stop) stop();
  if (controller) controller.abort();
  stop = null;
  controller = new AbortController();
  const signal = controller.signal;
  const path = location.pathname;
  const found = PAGES.find(([pattern]) => pattern.test(path));
  for (const a of /** @type {NodeListOf<HTMLAnchorElement>} */ (document.querySelectorAll("header nav a"))) {
    a.classList.toggle("current", found !== undefined && a.dataset.section === found[1]);
  }
  if (!found) {
    clear(main, h("h1", {}, "Not found"), h("p", {}, "No dashboard page has this address."));
    return;
  }
  const [pattern, , load] = found;
  const params = /** @type {RegExpExecArray} */ (pattern.exec(path)).slice(1).map(decodeURIComponent); // it matched
  try {
    const page = await load();
    if (signal.aborted) return;
    clear(main);
    const stopper = await page.render(main, params, signal);
    if (signal.aborted) {
      if (typeof stopper === "function") stopper();
    } else {
      stop = typeof stopper === "function" ? stopper : null;
    }
  } catch (error) {
    if (/** @type {Error} */ (error).name === "AbortError" || signal.aborted) return;
    clear(main, failure(error));
  }
}

// Draw another dashboard page without reloading; `replace` keeps the history entry (a filter changed).
/**
 * @param {string} href  a path under /ui, with its query
 * @param {{ replace?: boolean }} [options]
 */
export function go(href, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", href);
  else history.pushState(null, "", href);
  show();
}

document.addEventListener("click", (event) => {
  const a = /** @type {HTMLAnchorElement | null} */ (/** @type {Element} */ (event.target).closest("a[href]"));
  if (!a || event.defaultPrevented || event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey) return;
  const url = new URL(a.href, location.href);
  if (url.origin !== location.origin || !url.pathname.startsWith("/ui") || a.target) return;
  if (url.pathname === location.pathname && url.search === location.search && url.hash) return; // an anchor
  event.preventDefault();
  if (url.href !== location.href) go(url.pathname + url.search);
});
// A move between anchors of the page drawn (a link to #call-3, or back from it) keeps the page as it is.
window.addEventListener("popstate", () => location.pathname + location.search !== drawn && show());
/** @type {HTMLButtonElement} */ (document.getElementById("forget-token")).addEventListener("click", () => {
  forgetToken();
  show();
});
showForget();
show();
