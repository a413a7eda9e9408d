// The server's API as the page uses it: the API key (asked once, kept in local storage),
// fetch with that key, and a reader of Server-Sent Events over fetch (EventSource cannot
// send an Authorization header).
"use strict";

const KEY_STORAGE = "conveyor.apiKey";

const api = {
  key() { return localStorage.getItem(KEY_STORAGE) || ""; },

  // Every request of the page says it is the page's: behind `--replicas` the router sends
  // them all to one replica, the one the live view watches.
  headers(extra = {}) {
    const key = api.key();
    const headers = { ...extra, "X-Conveyor-Live-View": "1" };
    return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
  },

  // One dialog at a time, however many requests were refused together.
  _asking: null,
  askKey() {
    if (!api._asking) {
      api._asking = new Promise((resolve) => {
        const dialog = document.getElementById("key-dialog");
        const input = document.getElementById("key-input");
        input.value = api.key();
        dialog.addEventListener("close", () => {
          if (dialog.returnValue === "ok") {
            localStorage.setItem(KEY_STORAGE, input.value.trim());
            window.dispatchEvent(new Event("conveyor-key"));
          }
          api._asking = null;
          resolve(dialog.returnValue === "ok");
        }, { once: true });
        dialog.returnValue = "";  // (Escape keeps the last value: a Save before is no Save now)
        dialog.showModal();
        input.focus();
      });
    }
    return api._asking;
  },

  // fetch with the key; a 401 asks for the key and tries again (until the user cancels:
  // then the 401 is returned).
  async fetch(path, options = {}) {
    for (;;) {
      const response = await fetch(path, { ...options, headers: api.headers(options.headers) });
      if (response.status !== 401) return response;
      if (!(await api.askKey())) return response;
    }
  },

  async postJSON(path, body, signal) {
    return api.fetch(path, {
      method: "POST", body: JSON.stringify(body), signal,
      headers: { "Content-Type": "application/json" },
    });
  },

  // Yields {event, data} for each event of a text/event-stream response.
  async *events(response) {
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
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  },

  async errorText(response) {
    try {
      const body = await response.json();
      return body.error?.message || JSON.stringify(body);
    } catch {
      return `HTTP ${response.status}`;
    }
  },
};

document.getElementById("key-button").addEventListener("click", () => api.askKey());
