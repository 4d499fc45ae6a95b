// The one way the pages reach the server: fetch calls to /admin/v1 on this origin. The admin token, when the
// server asks for one (a 401), is typed once into a dialog, kept in this tab's sessionStorage and sent as
// `Authorization: Bearer`; it never goes into a URL, the page or the console.

const KEY = "rollway.adminToken";
const BASE = "/admin/v1";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let asking = null; // one dialog for every request that got a 401 at the same time

function askToken(refused) {
  if (asking) return asking;
  const dialog = document.getElementById("token-dialog");
  const form = document.getElementById("token-form");
  const input = document.getElementById("token-input");
  document.getElementById("token-error").hidden = !refused;
  input.value = "";
  asking = new Promise((resolve) => {
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
  const button = document.getElementById("forget-token");
  button.hidden = sessionStorage.getItem(KEY) === null;
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
  showForget();
}

// GET (or `method`) `path` under /admin/v1; `query` an object whose arrays repeat the parameter. Answers the
// parsed JSON (null for 204); throws ApiError with the server's message otherwise.
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
export async function each(path, query, signal, limit = 500) {
  const items = [];
  let cursor;
  do {
    const page = await api(path, { query: { ...query, limit, cursor }, signal });
    items.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor);
  return items;
}
