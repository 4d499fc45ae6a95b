// @ts-check
// One rollout (/ui/rollouts/{id}, ?attempt= another attempt than the latest): its attempts on a timeline with a
// tick per LLM call, each LLM call of the attempt in sequence order (the request as a chat, the response and its
// tool calls, the tokens coloured by logprob, latency, model version, errors), the rewards, and the training data
// the export makes of it (triplets, and merged rows with their loss mask). Spans are read PAGE at a time; a
// call's body is drawn when it nears the viewport, so a rollout of hundreds of calls opens at once. While the
// rollout is in progress and "live" is on, the page follows it every LIVE seconds: status, attempts and
// timeline are drawn again, new spans are added below the calls already drawn, which are left as they are.

import { api } from "../api.js";
import { badge, clear, duration, every, failure, h, json, link, malformed, number, recordedDuration, recordedNumber, recordedText, s, seg, time } from "../dom.js";
import { maskView, tokenView } from "../tokens.js";

/** @import { Attempt, LlmRequest, LlmResponse, MergedRow, Page, Rollout, Span, Triplet } from "../api.js" */

/**
 * The recorded request and answer are whatever the agent sent and the engine answered: these name the parts
 * this page draws, each checked at run time before it is used.
 *
 * @typedef {object} ChatItem  a chat message, or an item of a responses request's input
 * @property {string} [role]
 * @property {string} [type]  "message", "function_call", "function_call_output", … (responses)
 * @property {string} [name]
 * @property {string} [tool_call_id]
 * @property {unknown} [content]
 * @property {unknown} [tool_calls]
 * @property {unknown} [output]
 *
 * @typedef {object} Choice  a choice of a chat or completions answer
 * @property {number} [index]
 * @property {{ content?: unknown, tool_calls?: unknown }} [message]
 * @property {string} [text]
 * @property {string | null} [finish_reason]
 * @property {{ content?: unknown, tokens?: unknown } | null} [logprobs]
 *
 * @typedef {HTMLElement & { span: Span }} CallCard  a call's card, holding its span to draw the body from later
 */

const PAGE = 50;
const LIVE = 5; // seconds between refreshes of a rollout in progress while "live" is on, as on the rollouts list
const LATE = PAGE; // a span missing this many ids or fewer below the highest shown is looked for at each refresh
const REWARD = "rollway.reward";
const FINISHED = ["succeeded", "failed", "cancelled"];

// A message's content as text: a string as it is, the parts of a list one a line, anything else as JSON.
/** @param {unknown} content */
function text(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) {
    return content
      .map((part) => {
        if (typeof part === "string") return part;
        if (part && typeof part.text === "string") return part.text;
        if (part && part.type) return `[${part.type}]`;
        return JSON.stringify(part);
      })
      .join("\n");
  }
  return JSON.stringify(content, null, 2);
}

// Whether a recorded value is an object whose fields may be read (not null, not a list).
/**
 * @param {unknown} value
 * @returns {value is Record<string, any>}
 */
function isObject(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

/** @param {unknown} calls  a list of tool calls (chat) or function_call items (responses); null for none */
function toolCalls(calls) {
  if (calls === null || calls === undefined || (Array.isArray(calls) && !calls.length)) return null;
  if (!Array.isArray(calls)) return h("ul", { class: "tool-calls" }, h("li", {}, malformed(calls)));
  return h(
    "ul",
    { class: "tool-calls" },
    calls.map((c) => {
      if (!isObject(c)) return h("li", {}, malformed(c));
      const fn = isObject(c.function) ? c.function : c;
      const call = h("code", {}, recordedText(fn.name, "?"), "(", recordedText(fn.arguments), ")");
      return h("li", {}, call, c.id ? h("span", { class: "muted" }, " ", recordedText(c.id)) : null);
    }),
  );
}

/** @param {unknown} item  a chat message or a responses input item, as recorded */
function message(item) {
  if (!isObject(item)) return h("div", { class: "msg" }, malformed(item));
  const m = /** @type {ChatItem} */ (item);
  const named = m.role ?? m.type ?? "item";
  const role = typeof named === "string" ? named : "item";
  return h(
    "div",
    { class: `msg role-${role}` },
    h("div", { class: "role" }, recordedText(named), m.name ? [" (", recordedText(m.name), ")"] : "", m.tool_call_id ? [" → ", recordedText(m.tool_call_id)] : ""),
    m.content !== undefined && m.content !== null ? h("div", { class: "content" }, text(m.content)) : null,
    toolCalls(m.tool_calls),
    m.type === "function_call" ? toolCalls([m]) : null,
    m.type === "function_call_output" ? h("div", { class: "content" }, text(m.output)) : null,
  );
}

/** @param {unknown} recorded  the span's rollway.request */
function requestView(recorded) {
  if (recorded === null || recorded === undefined) return h("p", { class: "muted" }, "No request recorded.");
  if (!isObject(recorded)) return h("p", {}, "request: ", malformed(recorded));
  const request = /** @type {LlmRequest} */ (recorded);
  if (Array.isArray(request.messages)) return h("div", { class: "chat" }, request.messages.map(message));
  if (request.input !== undefined) {
    const input = typeof request.input === "string" ? [{ role: "user", content: request.input }] : request.input;
    const system = request.instructions ? [{ role: "system", content: request.instructions }] : [];
    return h("div", { class: "chat" }, [...system, ...(Array.isArray(input) ? input : [input])].map(message));
  }
  if (request.prompt !== undefined) return h("div", { class: "content prompt" }, text(request.prompt));
  return json(request);
}

/**
 * @param {unknown} recorded  the span's rollway.response
 * @param {unknown} operation  the span's gen_ai.operation.name: "chat", "text_completion", …
 */
function responseView(recorded, operation) {
  if (recorded === null || recorded === undefined) return h("p", { class: "muted" }, "No response recorded.");
  if (!isObject(recorded)) return h("p", {}, "response: ", malformed(recorded));
  const response = /** @type {LlmResponse} */ (recorded);
  if (Array.isArray(response.output)) {
    return h(
      "div",
      { class: "response" },
      response.output.map((item) => {
        if (!isObject(item)) return h("div", { class: "content response-text" }, malformed(item));
        if (item.type === "message") return h("div", { class: "content response-text" }, text(item.content));
        if (item.type === "function_call") return toolCalls([item]);
        if (item.type === "reasoning") return h("div", { class: "content reasoning" }, text(item.summary ?? item.content));
        return json(item);
      }),
    );
  }
  /** @type {Choice[]} */
  const choices = Array.isArray(response.choices) ? response.choices : [];
  return h(
    "div",
    { class: "response" },
    choices.map((c, i) => {
      if (!isObject(c)) return h("div", { class: "choice" }, h("div", { class: "content response-text" }, malformed(c)));
      const reply = isObject(c.message) ? c.message : null;
      return h(
        "div",
        { class: "choice" },
        choices.length > 1 ? h("div", { class: "muted" }, "choice ", recordedNumber(c.index ?? i, 0)) : null,
        operation === "chat" || c.message
          ? [h("div", { class: "content response-text" }, reply ? text(reply.content ?? "") : malformed(c.message)), toolCalls(reply?.tool_calls)]
          : h("div", { class: "content response-text" }, recordedText(c.text)),
        c.finish_reason ? h("div", { class: "muted" }, "finish: ", recordedText(c.finish_reason)) : null,
      );
    }),
  );
}

// Token strings aligned with the ids, when the answer's logprobs carry them.
// Each is a string, or null where the recorded one is not (the token is then shown as its id).
/**
 * @param {unknown} response  the span's rollway.response
 * @param {number} count  the number of token ids
 * @returns {(string | null)[] | null}
 */
function tokenTexts(response, count) {
  const choices = isObject(response) && Array.isArray(response.choices) ? response.choices : [];
  const lp = isObject(choices[0]) && isObject(choices[0].logprobs) ? choices[0].logprobs : null;
  /** @type {unknown[] | null} */
  let texts = null;
  if (Array.isArray(lp?.content)) texts = lp.content.map((t) => (isObject(t) ? t.token : null));
  else if (Array.isArray(lp?.tokens)) texts = lp.tokens;
  return texts && texts.length === count ? texts.map((t) => (typeof t === "string" ? t : null)) : null;
}

/** @param {Span} span */
function callBody(span) {
  const a = span.attributes;
  const operation = a["gen_ai.operation.name"];
  const ids = a["rollway.response_token_ids"];
  const body = h("div", { class: "call-body" });
  const error = a["rollway.error"] ?? (span.status?.status_code === "ERROR" ? span.status.description : null);
  if (error) body.append(h("p", { class: "error call-error" }, "error: ", recordedText(error), a["error.type"] ? [" (", recordedText(a["error.type"]), ")"] : ""));
  body.append(
    h("div", { class: "columns" }, h("div", {}, h("h4", {}, "request"), requestView(a["rollway.request"])), h("div", {}, h("h4", {}, "response"), responseView(a["rollway.response"], operation))),
  );
  if (Array.isArray(ids) && ids.length) {
    const holder = h("div", { class: "token-holder" });
    const button = h("button", { type: "button", class: "show-tokens" }, `tokens (${ids.length})`);
    button.addEventListener("click", () => {
      if (holder.firstChild) {
        holder.hidden = !holder.hidden;
        return;
      }
      holder.append(tokenView(ids, a["rollway.response_logprobs"], tokenTexts(a["rollway.response"], ids.length)));
    });
    body.append(button, holder);
  } else if (ids === null || ids === undefined || Array.isArray(ids)) {
    body.append(h("p", { class: "muted" }, "No token ids recorded for this call."));
  } else {
    body.append(h("p", { class: "token-ids" }, "token ids: ", malformed(ids)));
  }
  return body;
}

/**
 * @param {Span} span
 * @param {IntersectionObserver} observer  draws the card's body when it nears the viewport
 * @returns {CallCard}
 */
function callCard(span, observer) {
  const a = span.attributes;
  const ok = span.status?.status_code !== "ERROR";
  const tokens = [recordedNumber(a["gen_ai.usage.input_tokens"], 0, "?"), " → ", recordedNumber(a["gen_ai.usage.output_tokens"], 0, "?"), " tokens"];
  const card = /** @type {CallCard} */ (h(
    "article",
    { class: "call", dataset: { sequence: span.sequence_id }, id: `call-${span.sequence_id}` },
    h(
      "header",
      {},
      h("span", { class: "seq" }, `#${span.sequence_id}`),
      h("span", {}, recordedText(a["gen_ai.operation.name"] ?? span.name)),
      h("span", { class: "model" }, recordedText(a["gen_ai.request.model"])),
      h("span", { class: "version", title: "model version" }, a["rollway.model_version"] ? ["version ", recordedText(a["rollway.model_version"])] : ""),
      h("span", { class: "latency", title: "latency" }, recordedDuration(a["rollway.latency_seconds"])),
      a["rollway.ttft_seconds"] !== null && a["rollway.ttft_seconds"] !== undefined ? h("span", { title: "time to first token" }, "TTFT ", recordedDuration(a["rollway.ttft_seconds"])) : null,
      h("span", { class: "usage" }, tokens),
      badge(ok ? "ok" : "error"),
      // Token ids but not a logprob for every output token: no importance ratio for it.
      a["rollway.trainable"] === true && a["rollway.logprobs_complete"] === false
        ? h("span", { class: "badge no-logprobs status-error", title: "the engine returned token ids without a logprob for every output token" }, "no logprobs")
        : null,
      h("span", { class: "reward-slot" }),
    ),
    h("div", { class: "call-body placeholder" }, "…"),
  ));
  card.span = span;
  observer.observe(card);
  return card;
}

/** @param {Span} span */
function otherSpan(span) {
  return h("article", { class: "call other", dataset: { sequence: span.sequence_id } }, h("header", {}, h("span", { class: "seq" }, `#${span.sequence_id}`), h("span", {}, span.name)));
}

/** @param {Span} span */
function isCall(span) {
  return Boolean(span.attributes && span.attributes["gen_ai.operation.name"] && span.attributes["rollway.request"] !== undefined);
}

// The attempts on a time axis, one row each, and a tick on the shown attempt's row at the start of each of its
// calls (`calls`, in sequence order): no labels, so hundreds stay readable; each tick's <title> names the call,
// and a click on one calls `pick` with its sequence id.
/**
 * @param {Rollout} rollout
 * @param {Attempt[]} attempts
 * @param {Attempt | null} current  the attempt shown
 * @param {Span[]} calls
 * @param {(sequence: number) => void} pick
 */
function timeline(rollout, attempts, current, calls, pick) {
  const start = rollout.start_time;
  let end = rollout.end_time ?? Date.now() / 1000;
  for (const a of attempts) end = Math.max(end, a.end_time ?? a.last_heartbeat_time ?? a.start_time);
  for (const c of calls) end = Math.max(end, c.start_time ?? start);
  const span = Math.max(end - start, 1e-3);
  const W = 600;
  const rowH = 18;
  const x = (/** @type {number} */ t) => 90 + ((t - start) / span) * (W - 100);
  const svg = s("svg", { viewBox: `0 0 ${W} ${(attempts.length + 1) * rowH + 16}`, class: "timeline", role: "img", "aria-label": "status timeline" });
  svg.append(
    s("text", { x: 0, y: 13, class: "axis" }, "rollout"),
    s("rect", { x: x(start), y: 4, width: Math.max(2, x(end) - x(start)), height: 10, class: `bar status-${rollout.status}` }, s("title", {}, `${rollout.status} ${time(start)} → ${time(rollout.end_time)}`)),
  );
  attempts.forEach((a, i) => {
    const y = (i + 1) * rowH + 4;
    const stop = a.end_time ?? a.last_heartbeat_time ?? end;
    svg.append(
      s("text", { x: 0, y: y + 9, class: "axis" }, `attempt ${a.sequence_id}`),
      s("rect", { x: x(a.start_time), y, width: Math.max(2, x(stop) - x(a.start_time)), height: 10, class: `bar status-${a.status}` }, s("title", {}, `${a.status} ${time(a.start_time)} → ${time(a.end_time)}`)),
    );
  });
  const row = attempts.findIndex((a) => a.attempt_id === current?.attempt_id);
  if (row >= 0 && calls.length) {
    const y = (row + 1) * rowH + 4;
    // `current` is the attempt of row `row`, found above, so not null here.
    const ticks = s("g", { class: "ticks", "aria-label": `calls of attempt ${/** @type {Attempt} */ (current).sequence_id}` });
    for (const c of calls) {
      if (c.start_time === null || c.start_time === undefined) continue;
      const a = c.attributes;
      const latency = a["rollway.latency_seconds"];
      const took = typeof latency === "number" ? latency : c.end_time ? c.end_time - c.start_time : null;
      ticks.append(
        s(
          "rect",
          { x: x(c.start_time) - 0.5, y: y - 2, width: 1, height: 14, class: c.status?.status_code === "ERROR" ? "tick error" : "tick", dataset: { sequence: c.sequence_id } },
          s("title", {}, `#${c.sequence_id} · ${typeof a["gen_ai.request.model"] === "string" ? a["gen_ai.request.model"] : c.name} · ${duration(took)}`),
        ),
      );
    }
    ticks.addEventListener("click", (event) => {
      const tick = /** @type {SVGElement | null} */ (/** @type {Element} */ (event.target).closest(".tick"));
      if (tick) pick(Number(tick.dataset.sequence));
    });
    svg.append(ticks);
  }
  svg.append(s("text", { x: 90, y: (attempts.length + 1) * rowH + 14, class: "axis" }, time(start)), s("text", { x: W - 10, y: (attempts.length + 1) * rowH + 14, class: "axis", "text-anchor": "end" }, duration(end - start)));
  return svg;
}

/**
 * @param {Rollout} rollout
 * @param {Attempt[]} attempts
 * @param {Attempt | null} current  the attempt shown
 */
function attemptsTable(rollout, attempts, current) {
  return h(
    "table",
    { class: "grid", id: "attempts-table" },
    h("thead", {}, h("tr", {}, ["attempt", "status", "worker", "started", "ended", "took"].map((c) => h("th", {}, c)))),
    h(
      "tbody",
      {},
      attempts.map((a) =>
        h(
          "tr",
          { class: a.attempt_id === current?.attempt_id ? "current" : "" },
          h("td", {}, link(`/ui/rollouts/${seg(rollout.rollout_id)}?attempt=${seg(a.attempt_id)}`, `${a.sequence_id} · ${a.attempt_id}`)),
          h("td", {}, badge(a.status)),
          h("td", {}, a.worker_id ?? "—"),
          h("td", {}, time(a.start_time)),
          h("td", {}, time(a.end_time)),
          h("td", { class: "num" }, duration(a.end_time ? a.end_time - a.start_time : null)),
        ),
      ),
    ),
  );
}

/** @param {{ span: Span, call: number | null }[]} rewards  each with the sequence id of the call before it */
function rewardsTable(rewards) {
  if (!rewards.length) return h("p", { class: "muted", id: "no-rewards" }, "No reward recorded for this attempt.");
  return h(
    "table",
    { class: "grid", id: "rewards-table" },
    h("thead", {}, h("tr", {}, ["name", "value", "after call", "recorded"].map((c) => h("th", {}, c)))),
    h(
      "tbody",
      {},
      rewards.map(({ span, call }) =>
        h(
          "tr",
          { class: "reward", dataset: { value: typeof span.attributes["rollway.reward.value"] === "number" ? span.attributes["rollway.reward.value"] : "" } },
          h("td", {}, recordedText(span.attributes["rollway.reward.name"], "primary")),
          h("td", { class: "num reward-value" }, recordedNumber(span.attributes["rollway.reward.value"], 4)),
          h("td", {}, call ? link(`#call-${call}`, `#${call}`) : "—"),
          h("td", {}, time(span.start_time)),
        ),
      ),
    ),
  );
}

/**
 * @param {HTMLElement} box
 * @param {Rollout} rollout
 * @param {Attempt | null} attempt  the attempt shown
 * @param {AbortSignal} signal
 */
async function training(box, rollout, attempt, signal) {
  if (!FINISHED.includes(rollout.status)) {
    clear(box, h("p", { class: "muted" }, "Training data is exported once the rollout has finished."));
    return;
  }
  const query = { rollout_id: rollout.rollout_id, partial: true };
  const [triplets, merged] = await Promise.all([
    /** @type {Promise<Page<Triplet>>} */ (api("/triplets", { query, signal })),
    /** @type {Promise<Page<MergedRow>>} */ (api("/triplets", { query: { ...query, merge: true }, signal })),
  ]);
  const note = attempt && attempt.attempt_id !== triplets.items[0]?.attempt_id && triplets.items.length ? h("p", { class: "muted" }, "The export takes the latest attempt.") : null;
  const tripletTable = triplets.items.length
    ? h(
        "table",
        { class: "grid", id: "triplets-table" },
        h("thead", {}, h("tr", {}, ["call", "choice", "prompt tokens", "response tokens", "reward", "finish", "version"].map((c) => h("th", {}, c)))),
        h(
          "tbody",
          {},
          triplets.items.map((t) =>
            h(
              "tr",
              {},
              h("td", {}, link(`#call-${t.sequence_id}`, `#${t.sequence_id}`)),
              h("td", { class: "num" }, t.choice_index),
              h("td", { class: "num" }, number(t.prompt_token_ids.length)),
              h("td", { class: "num" }, number(t.response_token_ids.length)),
              h("td", { class: "num" }, number(t.reward, 4)),
              h("td", {}, t.finish_reason ?? "—"),
              h("td", {}, t.model_version ?? "—"),
            ),
          ),
        ),
      )
    : h("p", { class: "muted" }, "No trainable call (no token ids recorded).");
  const breaks = merged.items[0]?.prefix_breaks ?? 0;
  const rows = merged.items.map((row, i) => {
    const holder = h("div", {});
    const trained = row.loss_mask.reduce((sum, m) => sum + m, 0);
    const button = h("button", { type: "button", class: "show-sequence" }, "sequence");
    button.addEventListener("click", () => {
      if (holder.firstChild) holder.hidden = !holder.hidden;
      else holder.append(maskView(row.token_ids, row.loss_mask));
    });
    return h(
      "div",
      { class: "merged-row", dataset: { row: i } },
      h("p", {}, h("strong", {}, `row ${i + 1}`), ` · ${row.n_calls} calls · ${number(row.token_ids.length)} tokens, ${number(trained)} trained (loss mask 1) · reward ${number(row.reward, 4)} `, button),
      holder,
    );
  });
  clear(
    box,
    note,
    h("h3", {}, "Triplets"),
    tripletTable,
    h("h3", {}, "Merged sequence"),
    h("p", { id: "prefix-breaks" }, `${breaks} prefix break${breaks === 1 ? "" : "s"}: `, breaks ? "a call's prompt did not extend the conversation before it, so a new row starts." : "every call extends the one before it."),
    rows.length ? rows : h("p", { class: "muted" }, "No merged row."),
    h("p", { class: "legend-line" }, h("span", { class: "tok trained" }, "trained"), " ", h("span", { class: "tok context" }, "context (prompt, tool output)")),
  );
}

/**
 * @param {HTMLElement} main
 * @param {string[]} params  [the rollout id]
 * @param {AbortSignal} signal
 * @returns {Promise<() => void>}
 */
export async function render(main, [rolloutId], signal) {
  let rollout = /** @type {Rollout} */ (await api(`/rollouts/${seg(rolloutId)}`, { signal }));
  const wanted = new URL(location.href).searchParams.get("attempt");
  const status = h("span", { id: "rollout-status" }, badge(rollout.status));
  const ended = h("dd", { id: "rollout-ended" }, time(rollout.end_time));
  const about = json({ input: rollout.input, config: rollout.config, metadata: rollout.metadata });
  const attemptsBox = h("div", { id: "attempts" });
  const callsTitle = h("h2", {}, "Calls");
  const progress = h("p", { class: "muted", id: "calls-progress" });
  const trouble = h("div", { id: "calls-trouble" }); // why the last read failed, until one succeeds
  const calls = h("div", { id: "calls" });
  const noCalls = h("p", { class: "muted", id: "no-calls", hidden: true }, "No LLM call recorded for this attempt.");
  const rewardsBox = h("div", { id: "rewards" }, h("p", { class: "muted" }, "Loading…"));
  const trainingBox = h("div", { id: "training" }, h("p", { class: "muted" }, "Loading…"));
  const live = h("input", { type: "checkbox", id: "live", checked: true });
  const note = h("span", { class: "muted", id: "refreshed" });
  main.append(
    h("h1", {}, "Rollout ", h("code", { id: "rollout-id" }, rollout.rollout_id), " ", status),
    // Only a rollout still in progress has anything to follow.
    ...(FINISHED.includes(rollout.status) ? [] : [h("div", { class: "bar", id: "live-bar" }, h("label", {}, live, " live"), note)]),
    h(
      "dl",
      { class: "facts" },
      h("dt", {}, "mode"),
      h("dd", {}, rollout.mode ?? "—"),
      h("dt", {}, "group"),
      h("dd", {}, rollout.group_id ? [link(`/ui/groups/${seg(rollout.group_id)}`, rollout.group_id), ` #${rollout.group_index ?? ""} of ${rollout.group_size ?? "?"}`] : "—"),
      h("dt", {}, "resources"),
      h("dd", {}, rollout.resources_id ?? "—"),
      h("dt", {}, "started"),
      h("dd", {}, time(rollout.start_time)),
      h("dt", {}, "ended"),
      ended,
    ),
    h("details", {}, h("summary", {}, "input, config and metadata"), about),
    h("h2", {}, "Attempts"),
    attemptsBox,
    callsTitle,
    progress,
    trouble,
    calls,
    noCalls,
    h("h2", {}, "Rewards"),
    rewardsBox,
    h("h2", {}, "Training view"),
    trainingBox,
  );

  const observer = new IntersectionObserver(
    (entries) => {
      for (const entry of entries) {
        if (!entry.isIntersecting) continue;
        const card = /** @type {CallCard} */ (entry.target); // only call cards are observed
        observer.unobserve(card);
        /** @type {Element} */ (card.querySelector(".call-body.placeholder")).replaceWith(callBody(card.span));
      }
    },
    { rootMargin: "800px 0px" },
  );

  // What the page holds of the attempt it shows: the sequence ids of every span read, the highest of them, and
  // the calls and rewards among them, each in sequence order. Cards once drawn are never drawn again, so an
  // opened body or token view stays as the user left it.
  /** @type {Attempt | null} */
  let attempt = null;
  /** @type {Set<number>} */
  let seen = new Set();
  let high = 0;
  /** @type {Span[]} */
  let callSpans = [];
  /** @type {Span[]} */
  let rewards = [];
  /** @param {Attempt | null} next */
  const follow = (next) => {
    attempt = next;
    seen = new Set();
    high = 0;
    callSpans = [];
    rewards = [];
    observer.disconnect();
    clear(calls);
    clear(callsTitle, "Calls", next ? ` of attempt ${next.sequence_id}` : "");
  };
  /** @param {number} sequence */
  const pick = (sequence) => {
    const card = calls.querySelector(`#call-${sequence}`);
    if (!card) return;
    for (const other of calls.querySelectorAll("article.picked")) other.classList.remove("picked");
    card.classList.add("picked");
    card.scrollIntoView({ block: "start" });
  };
  // Adds the spans of `items` (ascending sequence ids) not shown yet; answers whether there were any. A span
  // can come in after one with a higher id (ids are taken when a call arrives, its span written when it ends),
  // so one below the highest shown goes in its place in the list rather than at the end.
  /**
   * @param {Span[]} items
   * @returns {boolean}
   */
  const take = (items) => {
    const tail = document.createDocumentFragment();
    let added = false;
    for (const span of items) {
      const sequence = span.sequence_id;
      if (seen.has(sequence)) continue;
      seen.add(sequence);
      added = true;
      /** @type {HTMLElement | null} */
      let card = null;
      if (span.name === REWARD) {
        rewards.push(span);
      } else if (isCall(span)) {
        card = callCard(span, observer);
        const at = callSpans.findLastIndex((c) => c.sequence_id < sequence);
        callSpans.splice(at + 1, 0, span);
      } else {
        card = otherSpan(span);
      }
      if (card && sequence > high) tail.append(card);
      else if (card) calls.insertBefore(card, [.../** @type {HTMLCollectionOf<HTMLElement>} */ (calls.children)].find((c) => Number(c.dataset.sequence) > sequence) ?? null);
      high = Math.max(high, sequence);
    }
    calls.append(tail);
    progress.textContent = `${callSpans.length} call${callSpans.length === 1 ? "" : "s"}`;
    return added;
  };
  // The after_sequence to read from: below the lowest id from `floor` up that is not shown yet, else the highest.
  /** @param {number} floor */
  const after = (floor) => {
    for (let q = Math.max(1, floor); q <= high; q++) if (!seen.has(q)) return q - 1;
    return high;
  };
  // Reads the shown attempt's spans after sequence id `from` to the last; answers whether any was new. Called
  // only while an attempt is shown (`attempt` is not null).
  /**
   * @param {number} from
   * @returns {Promise<boolean>}
   */
  const read = async (from) => {
    let added = false;
    for (;;) {
      const query = { attempt_id: /** @type {Attempt} */ (attempt).attempt_id, after_sequence: from || undefined, limit: PAGE };
      const page = /** @type {Page<Span>} */ (await api(`/rollouts/${seg(rollout.rollout_id)}/spans`, { query, signal }));
      if (signal.aborted) return added;
      added = take(page.items) || added;
      if (page.items.length < PAGE) return added;
      from = page.items[page.items.length - 1].sequence_id;
    }
  };
  const drawRewards = () => {
    rewards.sort((a, b) => a.sequence_id - b.sequence_id);
    const paired = rewards.map((span) => ({ span, call: callSpans.findLast((c) => c.sequence_id < span.sequence_id)?.sequence_id ?? null }));
    for (const old of calls.querySelectorAll(".reward-badge")) old.remove();
    for (const { span, call } of paired) {
      const slot = call === null ? null : calls.querySelector(`#call-${call} .reward-slot`);
      if (slot) slot.append(h("span", { class: "reward-badge" }, "reward ", recordedNumber(span.attributes["rollway.reward.value"], 4)));
    }
    clear(rewardsBox, rewardsTable(paired));
  };

  // Draws the rollout and reads the spans it does not show yet. While the rollout is not finished and "live" is
  // on, it runs again every LIVE seconds: the rollout (status, attempts) is read again, and its spans after
  // the highest sequence id shown (and after a missing one up to LATE ids below it); once the rollout has
  // finished, a last read from the lowest missing id, the training view, and no more refreshes.
  let first = true;
  let done = false;
  /** @type {(() => void) | null} */
  let halt = null;
  const refresh = async () => {
    if (done || (!first && !live.checked)) return;
    try {
      if (!first) rollout = /** @type {Rollout} */ (await api(`/rollouts/${seg(rollout.rollout_id)}`, { signal }));
      if (signal.aborted) return;
      const finished = FINISHED.includes(rollout.status);
      const attempts = rollout.attempts ?? [];
      const shown = attempts.find((a) => a.attempt_id === wanted) ?? attempts[attempts.length - 1] ?? null;
      let changed = first || shown?.attempt_id !== attempt?.attempt_id;
      if (changed) follow(shown);
      else attempt = shown;
      if (attempt) changed = (await read(after(finished ? 1 : high - LATE + 1))) || changed;
      if (signal.aborted) return;
      clear(status, badge(rollout.status));
      ended.textContent = time(rollout.end_time);
      const facts = JSON.stringify({ input: rollout.input, config: rollout.config, metadata: rollout.metadata }, null, 2);
      if (about.textContent !== facts) about.textContent = facts;
      clear(attemptsBox, attempts.length ? [timeline(rollout, attempts, attempt, callSpans, pick), attemptsTable(rollout, attempts, attempt)] : h("p", { class: "muted" }, "No attempt yet (queued)."));
      if (changed) {
        noCalls.hidden = callSpans.length > 0;
        if (attempt) drawRewards();
        else clear(rewardsBox, h("p", { class: "muted" }, "No attempt yet."));
      }
      if (first || finished) training(trainingBox, rollout, attempt, signal).catch((error) => error.name !== "AbortError" && clear(trainingBox, failure(error)));
      clear(trouble);
      main.dataset.loaded = "true";
      if (finished) {
        done = true;
        if (halt) halt();
        live.checked = false;
        live.disabled = true;
        note.textContent = "finished: no more updates";
      } else {
        note.textContent = `updated ${new Date().toLocaleTimeString()}`;
      }
    } catch (error) {
      if (/** @type {Error} */ (error).name === "AbortError") return;
      clear(trouble, failure(error));
    } finally {
      first = false;
    }
  };
  halt = every(LIVE, refresh);
  if (done) halt();
  return () => {
    /** @type {() => void} */ (halt)(); // set just above
    observer.disconnect();
  };
}
