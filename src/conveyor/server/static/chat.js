// The chat: a conversation with the served model through POST /v1/chat/completions
// (streamed), kept in local storage; tokens per second and time to first token under
// each answer, measured here in the browser.
"use strict";

const CHAT_STORAGE = "conveyor.chat";
const chat = {
  model: null,
  messages: [],  // {role, content, reasoning?, stats?}
  controller: null,  // the AbortController of the answer being streamed
  el: {
    messages: document.getElementById("messages"),
    form: document.getElementById("chat-form"),
    prompt: document.getElementById("prompt"),
    send: document.getElementById("send"),
    stop: document.getElementById("stop"),
    newChat: document.getElementById("new-chat"),
    system: document.getElementById("system"),
    temperature: document.getElementById("temperature"),
    maxTokens: document.getElementById("max-tokens"),
  },
};

function saveChat() {
  const { system, temperature, maxTokens } = chat.el;
  localStorage.setItem(CHAT_STORAGE, JSON.stringify({
    messages: chat.messages,
    settings: { system: system.value, temperature: temperature.value, maxTokens: maxTokens.value },
  }));
}

function loadChat() {
  try {
    const saved = JSON.parse(localStorage.getItem(CHAT_STORAGE) || "null");
    if (!saved) return;
    chat.messages = saved.messages || [];
    const s = saved.settings || {};
    if (s.system !== undefined) chat.el.system.value = s.system;
    if (s.temperature !== undefined) chat.el.temperature.value = s.temperature;
    if (s.maxTokens !== undefined) chat.el.maxTokens.value = s.maxTokens;
  } catch { chat.messages = []; }
}

function statsText(stats) {
  if (!stats) return "";
  const parts = [`${stats.tokens} tokens`];
  if (stats.tokPerS !== null) parts.push(`${stats.tokPerS.toFixed(1)} tok/s`);
  if (stats.ttftMs !== null) parts.push(`TTFT ${Math.round(stats.ttftMs)} ms`);
  if (stats.note) parts.push(stats.note);
  return parts.join(" · ");
}

function addMessageElement(message) {
  const div = document.createElement("div");
  div.className = `msg ${message.role}`;
  // A reasoning model's thinking (the server's reasoning parser), above its answer
  const thinking = document.createElement("span");
  thinking.className = "thinking";
  thinking.textContent = message.reasoning || "";
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = message.content;
  const stats = document.createElement("span");
  stats.className = "stats";
  stats.textContent = statsText(message.stats);
  div.append(thinking, text, stats);
  chat.el.messages.append(div);
  chat.el.messages.scrollTop = chat.el.messages.scrollHeight;
  return { div, thinking, text, stats };
}

function renderChat() {
  chat.el.messages.replaceChildren();
  for (const m of chat.messages) addMessageElement(m);
}

function setBusy(busy) {
  chat.el.send.disabled = busy;
  chat.el.stop.disabled = !busy;
}

function requestBody() {
  const { system, temperature, maxTokens } = chat.el;
  // Answers that failed before their first token say nothing: they are not sent back.
  const messages = chat.messages.filter((m) => m.content)
    .map(({ role, content }) => ({ role, content }));
  if (system.value.trim()) messages.unshift({ role: "system", content: system.value });
  return {
    model: chat.model, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number(temperature.value), max_tokens: Number(maxTokens.value),
  };
}

// Streams the answer to `body` into `answer` (a message object) and its element `view`.
async function streamAnswer(body, answer, view, signal) {
  const started = performance.now();
  let first = null, last = null, chunks = 0, usageTokens = null;
  const finish = (note) => {
    const tokens = usageTokens ?? chunks;
    const seconds = first !== null && last > first ? (last - first) / 1000 : 0;
    answer.stats = {
      tokens, ttftMs: first === null ? null : first - started,
      tokPerS: seconds > 0 && tokens > 1 ? (tokens - 1) / seconds : null, note,
    };
    view.stats.textContent = statsText(answer.stats);
  };
  try {
    const response = await api.postJSON("/v1/chat/completions", body, signal);
    if (!response.ok) throw new Error(await api.errorText(response));
    for await (const { data } of api.events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usageTokens = chunk.usage.completion_tokens;
      const delta = chunk.choices?.[0]?.delta?.content;
      const thought = chunk.choices?.[0]?.delta?.reasoning;
      if (delta || thought) {
        last = performance.now();
        if (first === null) first = last;
        chunks += 1;
        if (thought) answer.reasoning = (answer.reasoning || "") + thought;
        if (delta) answer.content += delta;
        view.thinking.textContent = answer.reasoning || "";
        view.text.textContent = answer.content;
        chat.el.messages.scrollTop = chat.el.messages.scrollHeight;
      }
    }
    finish(null);
  } catch (error) {
    if (error.name === "AbortError") finish("stopped");
    else { finish(`error: ${error.message}`); view.div.classList.add("error"); }
  }
}

async function send(text) {
  chat.controller = new AbortController();  // busy from here: a second submit is ignored
  setBusy(true);
  if (!chat.model) await fetchModel();
  chat.messages.push({ role: "user", content: text });
  addMessageElement(chat.messages.at(-1));
  const body = requestBody();
  const answer = { role: "assistant", content: "", stats: null };
  chat.messages.push(answer);
  const view = addMessageElement(answer);
  saveChat();
  await streamAnswer(body, answer, view, chat.controller.signal);
  chat.controller = null;
  setBusy(false);
  saveChat();
}

function stop() {
  if (chat.controller) chat.controller.abort();  // closing the stream aborts the request
}

async function fetchModel() {
  let response;
  try {
    response = await api.fetch("/v1/models");
  } catch (error) {  // no HTTP answer: the next question asks again
    document.getElementById("model").textContent = `could not reach the server: ${error.message}`;
    return;
  }
  if (!response.ok) {
    document.getElementById("model").textContent = await api.errorText(response);
    return;
  }
  const body = await response.json();
  chat.model = body.data[0].id;
  document.getElementById("model").textContent = chat.model;
}

chat.el.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = chat.el.prompt.value.trim();
  if (!text || chat.controller) return;
  chat.el.prompt.value = "";
  send(text);
});
chat.el.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    chat.el.form.requestSubmit();
  }
});
document.addEventListener("keydown", (event) => {
  // (not the Escape that closes the key dialog: that one leaves the answer streaming)
  if (event.key === "Escape" && !document.getElementById("key-dialog").open) stop();
});
chat.el.stop.addEventListener("click", stop);
chat.el.newChat.addEventListener("click", () => {
  stop();
  chat.messages = [];
  renderChat();
  saveChat();
  chat.el.prompt.focus();
});
for (const input of [chat.el.system, chat.el.temperature, chat.el.maxTokens]) {
  input.addEventListener("change", saveChat);
}

loadChat();
renderChat();
fetchModel();
