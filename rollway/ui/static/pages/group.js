// @ts-check
// A group (/ui/groups/{id}): its members in group order with their status and rewards, the spread of the rewards
// (what GRPO-style training learns from: a group whose rewards are all equal teaches nothing), and whether the
// group is complete (every declared member finished).

import { api } from "../api.js";
import { badge, clear, failure, h, link, number, recordedNumber, recordedText, seg } from "../dom.js";

/** @import { GroupView, Page, Rollout, Span } from "../api.js" */

const REWARD = "rollway.reward";
const AT_ONCE = 8; // members whose rewards are read at the same time

// Each member's reward spans, by rollout id (a member with no attempt yet has none to read).
/**
 * @param {Rollout[]} rollouts
 * @param {AbortSignal} signal
 * @returns {Promise<Map<string, Span[]>>}
 */
async function rewardsOf(rollouts, signal) {
  /** @type {Map<string, Span[]>} */
  const out = new Map();
  let next = 0;
  const worker = async () => {
    while (next < rollouts.length) {
      const r = rollouts[next++];
      if (!r.attempt_count) continue;
      const page = /** @type {Page<Span>} */ (await api(`/rollouts/${seg(r.rollout_id)}/spans`, { query: { name: REWARD }, signal }));
      out.set(r.rollout_id, page.items.filter((s) => s.name === REWARD));
    }
  };
  await Promise.all(Array.from({ length: Math.min(AT_ONCE, rollouts.length) }, worker));
  return out;
}

/** @param {number[]} values */
function spread(values) {
  if (!values.length) return null;
  const mean = values.reduce((a, b) => a + b, 0) / values.length;
  const std = Math.sqrt(values.reduce((a, b) => a + (b - mean) ** 2, 0) / values.length);
  return { mean, std, min: Math.min(...values), max: Math.max(...values), n: values.length };
}

/**
 * Why the group gives GRPO no signal, when it does not: members without a call, or every answer the same.
 * @param {GroupView} group
 * @returns {HTMLElement | string}
 */
function health(group) {
  const { without_calls: without, identical_answers: identical } = group.health;
  if (!group.health.degenerate) return "";
  const reasons = [];
  if (without.length) {
    reasons.push(
      `${without.length} finished member${without.length === 1 ? "" : "s"} made no LLM call (${without.join(", ")}): ` +
        "a client-side cache may have answered them (dspy's cache is on by default: turn it off for rollouts).",
    );
  }
  if (identical) reasons.push("Every member that answered gave the same token ids: their advantages are all zero.");
  return h("p", { id: "group-health", class: "error" }, "Degenerate group. ", reasons.join(" "));
}

/**
 * @param {HTMLElement} main
 * @param {string[]} params  [the group id]
 * @param {AbortSignal} signal
 * @returns {Promise<void>}
 */
export async function render(main, [groupId], signal) {
  const group = /** @type {GroupView} */ (await api(`/groups/${seg(groupId)}`, { signal }));
  const rewardsBox = h("div", {}, h("p", { class: "muted" }, "Loading rewards…"));
  main.append(
    h("h1", {}, "Group ", h("code", {}, group.group_id), " ", badge(group.complete ? "complete" : "incomplete")),
    h("p", { id: "group-progress" }, `${group.finished} of ${group.size} members finished.`),
    health(group),
    rewardsBox,
  );
  let rewards;
  try {
    rewards = await rewardsOf(group.rollouts, signal);
  } catch (error) {
    clear(rewardsBox, failure(error));
    return;
  }
  if (signal.aborted) return;
  // A member's reward: its last reward named "primary" (the default name), else its last reward; as recorded
  // (a span's value may be of any type: only numbers count in the spread, the others are shown marked).
  const rewardOf = (/** @type {string} */ id) => {
    const spans = rewards.get(id) ?? [];
    const primary = spans.filter((s) => (s.attributes["rollway.reward.name"] ?? "primary") === "primary");
    const last = (primary.length ? primary : spans).at(-1);
    const value = last?.attributes["rollway.reward.value"];
    return value === undefined ? null : value;
  };
  const values = group.rollouts
    .map((r) => rewardOf(r.rollout_id))
    .filter((v) => typeof v === "number" && Number.isFinite(v))
    .map(Number);
  const stats = spread(values);
  clear(
    rewardsBox,
    h(
      "p",
      { id: "reward-spread" },
      stats
        ? `rewards: mean ${number(stats.mean, 4)}, std ${number(stats.std, 4)}, min ${number(stats.min, 4)}, max ${number(stats.max, 4)} over ${stats.n} member${stats.n === 1 ? "" : "s"}` +
            (stats.n > 1 && stats.std === 0 ? " (no spread: every member has the same reward)" : "")
        : "No member has a reward yet.",
    ),
    h(
      "table",
      { class: "grid", id: "members-table" },
      h("thead", {}, h("tr", {}, ["#", "rollout", "status", "reward", "other rewards"].map((c) => h("th", {}, c)))),
      h(
        "tbody",
        {},
        group.rollouts.map((r) => {
          const value = rewardOf(r.rollout_id);
          const others = (rewards.get(r.rollout_id) ?? []).filter((s) => (s.attributes["rollway.reward.name"] ?? "primary") !== "primary");
          return h(
            "tr",
            { class: "member", dataset: { rolloutId: r.rollout_id, reward: typeof value === "number" ? value : "" } },
            h("td", { class: "num" }, r.group_index ?? "—"),
            h("td", {}, link(`/ui/rollouts/${seg(r.rollout_id)}`, r.rollout_id)),
            h("td", {}, badge(r.status)),
            h("td", { class: "num reward-value" }, recordedNumber(value, 4)),
            h("td", {}, others.map((s, i) => [i ? ", " : "", recordedText(s.attributes["rollway.reward.name"]), "=", recordedNumber(s.attributes["rollway.reward.value"], 4)])),
          );
        }),
      ),
    ),
  );
  main.dataset.loaded = "true";
}
