// The live engine view, fed by GET /v1/engine/events: the batch timeline (as `conveyor
// bench compare` draws it, with the same colours, sent by the server), KV blocks over time,
// the block map and the counters. Drawn on canvases at most once per animation frame.
"use strict";

const TIMELINE_STEPS = 240;  // columns kept (the newest steps)
const KV_WINDOW_S = 60;
const RECONNECT_MS = 2000;
const FREE_COLOUR = "#f4f4f4", CACHED_COLOUR = "#c9c9c9", SHARED_COLOUR = "#333333";

const live = {
  info: null,
  colours: [],          // category value -> colour
  columns: [],          // [{step, cells: Map(request id -> category)}], oldest first
  states: new Map(),    // request id -> "waiting" | "running" (requests not ended)
  kv: [],               // [[time, blocks used]]
  now: 0,               // the latest event's time
  blockMap: null,
  peakBatch: 0,
  drawPending: false,
};

function category(name) {
  return live.info.categories.find(([, label]) => label.startsWith(name))[0];
}

function applyStep(step) {
  const C = live.cat;
  for (const rid of step.arrived) live.states.set(rid, "waiting");
  const cells = new Map();
  for (const [rid, , kind] of step.scheduled) {
    cells.set(rid, kind === "prefill" ? C.prefill : C.decode);
    live.states.set(rid, "running");
  }
  for (const rid of step.preempted) {
    cells.set(rid, C.preempted);
    live.states.set(rid, "waiting");
  }
  for (const [rid, state] of live.states) {
    if (!cells.has(rid)) cells.set(rid, state === "waiting" ? C.waiting : C.stalled);
  }
  for (const rid of step.finished) live.states.delete(rid);
  live.columns.push({ step: step.step, cells });
  if (live.columns.length > TIMELINE_STEPS) live.columns.shift();
  live.kv.push([step.time, step.kv_blocks_used]);
  live.peakBatch = Math.max(live.peakBatch, step.scheduled.length);
}

function applyEvent(event) {
  for (const step of event.steps) applyStep(step);
  for (const id of event.ended) {  // aborted between steps, or finished: no longer live
    for (const rid of [...live.states.keys()]) {
      if (rid === id || rid.startsWith(`${id}#`)) live.states.delete(rid);
    }
  }
  live.now = event.time;
  while (live.kv.length && live.kv[0][0] < event.time - KV_WINDOW_S) live.kv.shift();
  if (event.block_map) live.blockMap = event.block_map;
  const ms = (p) => (p.count ? [p.p50_ms, p.p90_ms, p.p99_ms].map((v) => Math.round(v)).join(" / ") + " ms" : "–");
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  set("running", event.num_requests_running);
  set("waiting", event.num_requests_waiting);
  set("tok-s", event.generation_tokens_per_s.toFixed(1));
  set("peak-batch", live.peakBatch);
  const total = live.info.kv_blocks_total;
  set("kv-used", `${event.kv_blocks_used} / ${total} (${(100 * event.kv_blocks_used / total).toFixed(1)} %)`);
  set("preemptions", event.num_preemptions);
  set("ttft", ms(event.ttft));
  set("tpot", ms(event.tpot));
  scheduleDraw();
}

function applyInfo(info) {
  live.info = info;
  live.cat = {
    waiting: category("waiting"), prefill: category("prefill"), decode: category("decode"),
    preempted: category("preempted"), stalled: category("running, not"),
  };
  for (const [value, , colour] of info.categories) live.colours[value] = colour;
  const legend = document.getElementById("legend");
  legend.replaceChildren(...info.categories.map(([, label, colour]) => {
    const li = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = colour;
    li.append(swatch, label);
    return li;
  }));
}

function scheduleDraw() {
  if (live.drawPending) return;
  live.drawPending = true;
  requestAnimationFrame(() => {
    live.drawPending = false;
    drawTimeline();
    drawKV();
    drawBlockMap();
  });
}

// A canvas sized to its box in device pixels; returns [context, width, height] in CSS pixels.
function canvasContext(id) {
  const canvas = document.getElementById(id);
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return [ctx, width, height];
}

function drawTimeline() {
  const [ctx, width, height] = canvasContext("timeline");
  const rows = new Map();  // request id -> row, in order of first appearance in the window
  for (const column of live.columns) for (const rid of column.cells.keys()) {
    if (!rows.has(rid)) rows.set(rid, rows.size);
  }
  const left = 4, bottom = 16;
  const cellW = (width - left) / TIMELINE_STEPS;
  const rowH = Math.min(12, (height - bottom) / Math.max(rows.size, 1));
  const x0 = left + (TIMELINE_STEPS - live.columns.length) * cellW;
  live.columns.forEach((column, i) => {
    for (const [rid, value] of column.cells) {
      ctx.fillStyle = live.colours[value];
      ctx.fillRect(x0 + i * cellW, rows.get(rid) * rowH, Math.max(cellW - 0.3, 1), Math.max(rowH - 1, 1));
    }
  });
  ctx.fillStyle = "#666";
  if (live.columns.length) {
    ctx.fillText(`step ${live.columns[0].step}`, x0, height - 3);
    const label = `step ${live.columns.at(-1).step}`;
    ctx.fillText(label, width - ctx.measureText(label).width - 2, height - 3);
  }
  ctx.fillText(`${rows.size} requests`, width / 2 - 30, height - 3);
}

function drawKV() {
  const [ctx, width, height] = canvasContext("kv-chart");
  const total = live.info ? live.info.kv_blocks_total : 1;
  const pad = 16, now = live.now;  // the server's clock: the steps' times are its own
  const x = (t) => pad + (width - 2 * pad) * (1 - (now - t) / KV_WINDOW_S);
  const y = (v) => height - pad - (height - 2 * pad) * (v / total);
  ctx.strokeStyle = "#888";
  ctx.setLineDash([4, 3]);
  ctx.beginPath(); ctx.moveTo(pad, y(total)); ctx.lineTo(width - pad, y(total)); ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = "#666";
  ctx.fillText(`${total} blocks`, pad, y(total) - 3);
  ctx.fillText(`-${KV_WINDOW_S} s`, pad, height - 3);
  ctx.fillText("now", width - pad - 18, height - 3);
  if (!live.kv.length) return;
  ctx.strokeStyle = "#1f77b4";
  ctx.fillStyle = "rgba(31, 119, 180, 0.15)";
  ctx.beginPath();
  ctx.moveTo(x(live.kv[0][0]), y(0));
  let previous = 0;
  for (const [t, used] of live.kv) { ctx.lineTo(x(t), y(previous)); ctx.lineTo(x(t), y(used)); previous = used; }
  ctx.lineTo(x(now), y(previous));
  ctx.lineTo(x(now), y(0));
  ctx.closePath();
  ctx.fill();
  ctx.stroke();
}

// A colour per request id: FNV-1a, then golden-angle steps, so that ids differing in one
// character (load-0-1, load-0-2) get far-apart hues.
function requestColour(rid) {
  let hash = 0x811c9dc5;
  for (const c of rid) hash = Math.imul(hash ^ c.charCodeAt(0), 16777619);
  return `hsl(${((hash >>> 0) * 137.508) % 360}, 62%, 60%)`;
}

function drawBlockMap() {
  const [ctx, width, height] = canvasContext("block-map");
  const map = live.blockMap;
  const total = live.info ? live.info.kv_blocks_total : 0;
  if (!total) return;
  const side = Math.max(1, Math.floor(Math.sqrt((width * height) / total)));
  let perRow = Math.floor(width / side);
  while (Math.ceil(total / perRow) * side > height && side > 1) perRow += 1;
  const colour = new Array(total).fill(FREE_COLOUR);
  if (map) {
    for (const b of map.cached) colour[b] = CACHED_COLOUR;
    for (const [rid, table] of Object.entries(map.tables)) for (const b of table) colour[b] = requestColour(rid);
    for (const b of map.shared) colour[b] = SHARED_COLOUR;
  }
  const cell = Math.min(side, width / perRow);
  for (let b = 0; b < total; b++) {
    ctx.fillStyle = colour[b];
    ctx.fillRect((b % perRow) * cell, Math.floor(b / perRow) * cell, Math.max(cell - (cell > 3 ? 1 : 0), 1), Math.max(cell - (cell > 3 ? 1 : 0), 1));
  }
}

async function connectEvents() {
  const status = document.getElementById("live-status");
  for (;;) {
    try {
      const response = await api.fetch("/v1/engine/events");
      if (response.status === 401) {  // the key dialog was cancelled: wait for a key
        status.textContent = "(needs the API key)";
        await new Promise((resolve) => window.addEventListener("conveyor-key", resolve, { once: true }));
        continue;
      }
      if (!response.ok) throw new Error(await api.errorText(response));
      status.textContent = "(live)";
      for await (const { event, data } of api.events(response)) {
        if (event === "info") applyInfo(JSON.parse(data));
        else if (event === "steps" && live.info) applyEvent(JSON.parse(data));
      }
      status.textContent = "(the server closed the stream)";
    } catch (error) {
      status.textContent = `(disconnected: ${error.message})`;
    }
    await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
  }
}

document.getElementById("load").addEventListener("click", async () => {
  const status = document.getElementById("load-status");
  const body = { num_requests: Number(document.getElementById("load-n").value) };
  const cap = document.getElementById("load-max-tokens").value;
  if (cap) body.max_tokens = Number(cap);
  status.textContent = "sending…";
  try {
    const response = await api.postJSON("/v1/engine/load", body);
    status.textContent = response.ok
      ? `${(await response.json()).request_ids.length} requests sent`
      : await api.errorText(response);
  } catch (error) {  // no HTTP answer at all (the server is down, the network failed)
    status.textContent = `could not reach the server: ${error.message}`;
  }
});
window.addEventListener("resize", scheduleDraw);
connectEvents();
