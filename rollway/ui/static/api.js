// @ts-check
// The one way the pages reach the server: fetch calls to /admin/v1 on this origin. The admin token, when the
// server asks for one (a 401), is typed once into a dialog, kept in this tab's sessionStorage and sent as
// `Authorization: Bearer`; it never goes into a URL, the page or the console.

/**
 * The admin API's objects the pages read, as its JSON answers carry them (the server's models in admin/schemas.py
 * and store/schemas.py); a field the server may leave empty is null. The pages import them with `@import`.
 *
 * @typedef {object} Attempt  one run of a rollout by a worker
 * @property {string} rollout_id
 * @property {string} attempt_id
 * @property {number} sequence_id  1 for the first attempt, then 2, …
 * @property {string} status
 * @property {string | null} worker_id
 * @property {number} start_time  seconds since the epoch, as every time here
 * @property {number | null} end_time
 * @property {number | null} last_heartbeat_time
 * @property {Record<string, unknown> | null} metadata
 *
 * @typedef {object} Rollout  GET /rollouts/{id}, and each item of GET /rollouts
 * @property {string} rollout_id
 * @property {unknown} input
 * @property {string | null} mode
 * @property {string | null} resources_id
 * @property {string} status
 * @property {Record<string, unknown>} config
 * @property {Record<string, unknown> | null} metadata
 * @property {string | null} group_id
 * @property {number | null} group_size
 * @property {number | null} group_index
 * @property {number} start_time
 * @property {number | null} end_time
 * @property {number} attempt_count
 * @property {Attempt[] | null} attempts  every attempt, oldest first (GET /rollouts/{id}; null in a listing)
 * @property {number | null} [reward]  in a listing: its primary reward (its latest attempt's last); null: none yet
 *
 * @typedef {object} SpanStatus
 * @property {"UNSET" | "OK" | "ERROR"} status_code
 * @property {string | null} description
 *
 * @typedef {object} LlmRequest  a recorded request body: chat (messages), responses (input) or completions (prompt)
 * @property {unknown} [messages]
 * @property {unknown} [input]
 * @property {unknown} [instructions]
 * @property {unknown} [prompt]
 *
 * @typedef {object} LlmResponse  a recorded answer: chat and completions (choices) or responses (output)
 * @property {unknown} [choices]
 * @property {unknown} [output]
 *
 * @typedef {Record<string, unknown>} SpanAttributes  a span's attributes as its writer sent them: the gateway
 *   writes numbers, lists and texts where they belong, but agents' tracers and OTLP exporters write spans too,
 *   with any type; the pages check each value before they use it (dom.js: recordedNumber, recordedText, malformed)
 *
 * @typedef {object} Span  each item of GET /rollouts/{id}/spans
 * @property {number} sequence_id
 * @property {string} name
 * @property {SpanStatus | null} status
 * @property {number | null} start_time
 * @property {number | null} end_time
 * @property {SpanAttributes} attributes
 *
 * @typedef {object} GroupView  GET /groups/{id}
 * @property {string} group_id
 * @property {number} size
 * @property {number} finished
 * @property {boolean} complete
 * @property {Rollout[]} rollouts  in group order
 * @property {GroupHealth} health
 *
 * @typedef {object} GroupHealth  whether the group's finished members can teach anything
 * @property {string[]} without_calls  finished members whose latest attempt made no LLM call
 * @property {boolean} identical_answers  two or more members answered, all with the same token ids
 * @property {boolean} degenerate  either
 *
 * @typedef {object} BackendView
 * @property {string} backend_id
 * @property {string} base_url
 * @property {string} kind
 * @property {string} model
 * @property {number} weight
 * @property {number | null} max_concurrency
 * @property {string | null} version
 * @property {boolean} has_api_key
 * @property {string | null} detected_kind  the engine an `auto` backend turned out to be; null until asked
 * @property {boolean | null} up  whether the gateway routes calls to it now; null when the server does not say
 *
 * @typedef {object} ModelView  GET /models/{alias}, each item of GET /models, and what pause, resume and swap answer
 * @property {string} alias
 * @property {BackendView[]} backends
 * @property {string} version
 * @property {Record<string, unknown> | null} sampling
 * @property {{ paused: boolean, in_flight: number, in_flight_old: number, updating: string | null }} state
 * @property {{ completions: number, untrainable: number, without_logprobs: number }} capture
 * @property {Record<string, EngineVersion>} engine_versions  by backend id: what its engine reports, as last checked
 *
 * @typedef {object} EngineVersion  the weight version an engine reports beside the one its calls are recorded under
 * @property {string} reported
 * @property {string} expected
 * @property {"match" | "mismatch" | "unset"} state
 * @property {number} checked_time
 *
 * @typedef {object} WeightUpdate  each item of GET /models/{alias}/updates: one weight update, from its begin to its end
 * @property {string} update_id
 * @property {string} alias
 * @property {"open" | "committed" | "failed" | "aborted" | "expired"} state
 * @property {"reload" | "trainer"} form
 * @property {"drain" | "abort"} in_flight
 * @property {string} from_version
 * @property {string} to_version
 * @property {string} by
 * @property {string | null} note
 * @property {number} begun_time
 * @property {number | null} finished_time
 * @property {number | null} held_seconds
 * @property {number} aborted_calls
 * @property {Record<string, string | null>} engine_versions
 * @property {string | null} error
 *
 * @typedef {object} ResourcesUpdate  one version of a resources bundle (GET /resources, GET /resources/latest)
 * @property {string} resources_id
 * @property {number} version
 * @property {number} create_time
 * @property {number} update_time
 * @property {Record<string, unknown>} resources
 *
 * @typedef {object} StatusCounts  GET /stats/status
 * @property {Record<string, number>} rollouts_by_status
 * @property {Record<string, number>} attempts_by_status
 * @property {number} queue_depth
 *
 * @typedef {object} SeriesPoint  the gateway's calls that started in one bucket [start, start + step)
 * @property {number} start
 * @property {number} calls
 * @property {number} calls_per_second
 * @property {number} errors
 * @property {number | null} latency_mean_seconds
 * @property {number | null} latency_max_seconds
 * @property {number | null} ttft_mean_seconds
 * @property {number} input_tokens
 * @property {number} output_tokens
 * @property {number} rewards  primary rewards recorded in the bucket
 * @property {number | null} reward_mean
 *
 * @typedef {object} SeriesView  GET /stats/series
 * @property {number} since
 * @property {number} step_seconds
 * @property {SeriesPoint[]} points  every bucket of the window, oldest first
 *
 * @typedef {object} Triplet  each item of GET /triplets
 * @property {string} attempt_id
 * @property {number} sequence_id
 * @property {number} choice_index
 * @property {number[]} prompt_token_ids
 * @property {number[]} response_token_ids
 * @property {number | null} reward
 * @property {string | null} finish_reason
 * @property {string | null} model_version
 *
 * @typedef {object} MergedRow  each item of GET /triplets?merge=true
 * @property {number[]} token_ids
 * @property {number[]} loss_mask  1 for a token trained on, 0 for context
 * @property {number | null} reward
 * @property {number} n_calls
 * @property {number} prefix_breaks
 */

/**
 * A page of a listing; `next_cursor` (in the cursor-paged ones) asks for the next, null after the last.
 * @template T
 * @typedef {{ items: T[], next_cursor?: string | null }} Page
 */

/** @typedef {string | number | boolean | null | undefined} QueryValue */

const KEY = "rollway.adminToken";
const BASE = "/admin/v1";

export class ApiError extends Error {
  /**
   * @param {number} status  the HTTP status of the answer
   * @param {string} message  the server's message, or the status line
   */
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** @type {Promise<void> | null} */
let asking = null; // one dialog for every request that got a 401 at the same time

/**
 * @param {boolean} refused  whether the token sent was refused (says so in the dialog)
 * @returns {Promise<void>} resolves once a token is stored
 */
function askToken(refused) {
  if (asking) return asking;
  const dialog = /** @type {HTMLDialogElement} */ (document.getElementById("token-dialog"));
  const form = /** @type {HTMLFormElement} */ (document.getElementById("token-form"));
  const input = /** @type {HTMLInputElement} */ (document.getElementById("token-input"));
  /** @type {HTMLElement} */ (document.getElementById("token-error")).hidden = !refused;
  input.value = "";
  asking = new Promise((resolve) => {
    /** @param {SubmitEvent} event */
    const done = (event) => {
      event.preventDefault();
      const token = input.value.trim();
      if (!token) return;
      sessionStorage.setItem(KEY, token);
      input.value = "";
      form.removeEventListener("submit", done);
      dialog.close();
      asking = null;
      showForget();
      resolve();
    };
    form.addEventListener("submit", done);
  });
  dialog.oncancel = (event) => event.preventDefault(); // Escape does not close it: the pages need the token
  if (!dialog.open) dialog.showModal();
  input.focus();
  return asking;
}

export function showForget() {
  const button = /** @type {HTMLButtonElement} */ (document.getElementById("forget-token"));
  button.hidden = sessionStorage.getItem(KEY) === null;
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
  showForget();
}

// GET (or `method`) `path` under /admin/v1; `query` an object whose arrays repeat the parameter. Answers the
// parsed JSON (null for 204); throws ApiError with the server's message otherwise. The answer is `unknown`
// here: each caller casts it to the admin API's object it asked for (the typedefs above).
/**
 * @param {string} path  under /admin/v1, e.g. `/rollouts/${seg(id)}`
 * @param {{ method?: string, body?: unknown, query?: Record<string, QueryValue | QueryValue[]>, signal?: AbortSignal }} [options]
 * @returns {Promise<unknown>}
 */
export async function api(path, { method = "GET", body, query, signal } = {}) {
  let url = BASE + path;
  if (query) {
    const params = new URLSearchParams();
    for (const [name, value] of Object.entries(query)) {
      for (const item of Array.isArray(value) ? value : [value]) {
        if (item !== undefined && item !== null && item !== "") params.append(name, String(item));
      }
    }
    const text = params.toString();
    if (text) url += "?" + text;
  }
  for (;;) {
    /** @type {Record<string, string>} */
    const headers = { Accept: "application/json" };
    const token = sessionStorage.getItem(KEY);
    if (token !== null) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(url, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: "no-store",
      credentials: "omit",
    });
    if (response.status === 401) {
      if (token !== null) forgetToken();
      await askToken(token !== null);
      continue;
    }
    const data = response.status === 204 ? null : await response.json().catch(() => null);
    if (!response.ok) {
      const message = (data && data.error && data.error.message) || `${response.status} ${response.statusText}`;
      throw new ApiError(response.status, message);
    }
    return data;
  }
}

// Every item of a cursor-paged listing, `limit` at a time (for small listings such as a group's rewards).
/**
 * @param {string} path
 * @param {Record<string, QueryValue | QueryValue[]>} query
 * @param {AbortSignal} signal
 * @param {number} [limit]
 * @returns {Promise<unknown[]>}
 */
export async function each(path, query, signal, limit = 500) {
  /** @type {unknown[]} */
  const items = [];
  /** @type {string | null | undefined} */
  let cursor;
  do {
    const page = /** @type {Page<unknown>} */ (await api(path, { query: { ...query, limit, cursor }, signal }));
    items.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor);
  return items;
}
