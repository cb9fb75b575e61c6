// The daemon's API from the page: the bearer token kept in this tab (sessionStorage) and sent with
// every call; OpenAI's error JSON turned into ApiError; the Server-Sent Events stream read with fetch
// (EventSource cannot send the Authorization header).

const KEY = "s2s-api-key";

export class ApiError extends Error {
  constructor(status, body) {
    const error = body && body.error ? body.error : {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || null;
    this.param = error.param || null;
    this.body = body;
  }
}

export class AuthError extends ApiError {}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

async function errorBody(response) {
  try {
    return await response.json();
  } catch {
    return null;
  }
}

/** fetch() with the key; throws AuthError on 401 and ApiError on any other error status. */
export async function api(path, { method = "GET", json, body, headers = {}, signal } = {}) {
  const sent = { ...headers };
  const key = apiKey();
  if (key) sent.Authorization = `Bearer ${key}`;
  if (json !== undefined) {
    sent["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers: sent, body, signal, cache: "no-store" });
  if (response.status === 401) throw new AuthError(401, await errorBody(response));
  if (!response.ok) throw new ApiError(response.status, await errorBody(response));
  return response;
}

export async function apiJson(path, options) {
  return (await api(path, options)).json();
}

/** Read the event stream at ``path``, calling onEvent(kind, payload) per event, until it ends. */
export async function readEvents(path, onEvent, signal) {
  const response = await api(path, { headers: { Accept: "text/event-stream" }, signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let kind = "message";
      let data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) kind = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (data) onEvent(kind, JSON.parse(data));
    }
  }
}
