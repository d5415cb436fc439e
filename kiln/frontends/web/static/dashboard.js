// Kiln's live dashboard. Polls /dashboard/api/stats, keeps a few minutes of
// history per model and route target, draws it with uPlot, and drives the
// model-control, routes and chat APIs with the API key the user gave (kept in
// sessionStorage, sent as a Bearer token). Text from the server is always set
// with textContent, never parsed as HTML.
"use strict";

// ?interval_ms=N, kept within [MIN_POLL_MS, MAX_POLL_MS]: each poll reads the whole metrics registry,
// so a value below 1 must not turn one tab into a busy loop against the server.
const MIN_POLL_MS = 250, MAX_POLL_MS = 60000;
const POLL_MS = pollInterval(new URLSearchParams(location.search).get("interval_ms"));

function pollInterval(text) {
  const ms = Number(text);
  if (text === null || text === "" || !Number.isFinite(ms)) return 1000;
  return Math.min(MAX_POLL_MS, Math.max(MIN_POLL_MS, ms));
}
const HISTORY = 300; // points kept per subject
const KEY_STORAGE = "kiln-api-key";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

const state = {
  key: sessionStorage.getItem(KEY_STORAGE),
  history: {}, // subject -> {t: [], values: {series: []}}
  charts: {}, // title -> uPlot
  subject: null, // the subject whose charts are shown
  latest: null, // the last stats document
  timer: null,
  chat: [], // the conversation: [{role, content}]
};

const $ = (id) => document.getElementById(id);

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  return fetch(path, opts);
}

async function errorText(response) {
  try {
    const body = await response.json();
    const error = body.error;
    return typeof error === "string" ? error : (error && error.message) || JSON.stringify(body);
  } catch (e) {
    return "HTTP " + response.status;
  }
}

// ---- login ---------------------------------------------------------------------

function showLogin(message) {
  stopPolling();
  $("main").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("server-status").textContent = "locked";
  $("server-status").className = "pill";
  $("api-key").focus();
}

async function start() {
  const auth = await (await fetch("/dashboard/api/auth")).json();
  if (auth.api_key_required && !state.key) {
    showLogin("");
    return;
  }
  await poll();
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  state.key = $("api-key").value;
  sessionStorage.setItem(KEY_STORAGE, state.key);
  await poll();
});

$("logout").addEventListener("click", () => {
  state.key = null;
  sessionStorage.removeItem(KEY_STORAGE);
  showLogin("");
});

// ---- polling -------------------------------------------------------------------

function stopPolling() {
  if (state.timer !== null) clearTimeout(state.timer);
  state.timer = null;
}

async function poll() {
  stopPolling();
  let response;
  try {
    response = await api("/dashboard/api/stats");
  } catch (e) {
    $("server-status").textContent = "unreachable";
    $("server-status").className = "pill unavailable";
    state.timer = setTimeout(poll, POLL_MS * 2);
    return;
  }
  if (response.status === 401) {
    state.key = null;
    sessionStorage.removeItem(KEY_STORAGE);
    showLogin("That API key was refused.");
    return;
  }
  if (!response.ok) {
    $("server-status").textContent = "error " + response.status;
    state.timer = setTimeout(poll, POLL_MS * 2);
    return;
  }
  const doc = await response.json();
  $("login").hidden = true;
  $("main").hidden = false;
  $("logout").hidden = !doc.server.auth;
  render(doc);
  state.timer = setTimeout(poll, POLL_MS);
}

// ---- figures -> history --------------------------------------------------------

function pct(v) { return v === null || v === undefined ? null : v * 100; }
function q(d, p) { return d ? d[p] : null; }

// Each kind's charts: title -> [[series label, function(figures, server) -> number|null], ...]
const CHARTS = {
  llm: {
    "Requests/s": [["requests", (f) => f.request_rate], ["errors", (f) => f.error_rate]],
    "Queue and running batch": [["waiting", (f) => f.waiting], ["running", (f) => f.running],
      ["in flight", (f) => f.in_flight]],
    "Batch size (sequences per step)": [["mean", (f) => f.batch_size]],
    "Latency (ms)": [["p50", (f) => q(f.latency_ms, "p50")], ["p90", (f) => q(f.latency_ms, "p90")],
      ["p99", (f) => q(f.latency_ms, "p99")]],
    "TTFT / TPOT (ms)": [["TTFT p50", (f) => q(f.ttft_ms, "p50")], ["TTFT p99", (f) => q(f.ttft_ms, "p99")],
      ["TPOT p50", (f) => q(f.tpot_ms, "p50")], ["TPOT p99", (f) => q(f.tpot_ms, "p99")]],
    "KV cache in use (%)": [["used", (f) => pct(f.kv_cache_usage)]],
    "Utilisation (%)": [["CPU", (f) => pct(f.cpu_utilisation)], ["engine busy", (f) => pct(f.busy_fraction)],
      ["GPU", (f, s) => gpu(s)]],
    "Cost per 1,000 requests (USD)": [["cost", (f) => f.cost_per_1k_usd]],
  },
  repository: {
    "Requests/s": [["requests", (f) => f.request_rate], ["errors", (f) => f.error_rate],
      ["inferences (rows)", (f) => f.inferences_per_s]],
    "Queue": [["queued", (f) => f.queue_length], ["in flight", (f) => f.in_flight]],
    "Batch size (rows per execution)": [["mean", (f) => f.batch_size]],
    "Latency (ms)": [["p50", (f) => q(f.latency_ms, "p50")], ["p90", (f) => q(f.latency_ms, "p90")],
      ["p99", (f) => q(f.latency_ms, "p99")]],
    "Utilisation (%)": [["busy", (f) => pct(f.busy_fraction)], ["server CPU", (f, s) => pct(s.cpu_utilisation)],
      ["GPU", (f, s) => gpu(s)]],
    "Cost per 1,000 requests (USD)": [["cost", (f) => f.cost_per_1k_usd]],
  },
  target: {
    "Requests/s": [["requests", (f) => f.request_rate], ["errors", (f) => f.error_rate]],
    "Latency (ms)": [["p50", (f) => q(f.latency_ms, "p50")], ["p99", (f) => q(f.latency_ms, "p99")]],
    "TTFT / TPOT (ms)": [["TTFT p99", (f) => q(f.ttft_ms, "p99")], ["TPOT p99", (f) => q(f.tpot_ms, "p99")]],
    "Share of the route (%)": [["share", (f) => pct(f.share)]],
    "Cost per 1,000 requests (USD)": [["cost", (f) => f.cost_per_1k_usd]],
  },
};

function gpu(server) {
  const gpus = server.gpus || [];
  if (!gpus.length) return null;
  return 100 * gpus.reduce((sum, g) => sum + (g.utilisation || 0), 0) / gpus.length;
}

function subjects(doc) {
  const out = [];
  for (const [name, figures] of Object.entries(doc.stats.models)) {
    out.push({id: "model:" + name, label: name, kind: figures.kind, figures: figures});
  }
  for (const [route, targets] of Object.entries(doc.stats.routes)) {
    for (const [target, figures] of Object.entries(targets)) {
      out.push({id: "route:" + route + ":" + target, label: "route " + route + " -> " + target, kind: "target",
        figures: figures});
    }
  }
  return out;
}

function record(doc) {
  const t = Date.now() / 1000;
  for (const s of subjects(doc)) {
    const h = state.history[s.id] || (state.history[s.id] = {t: [], values: {}, kind: s.kind});
    h.t.push(t);
    for (const [title, series] of Object.entries(CHARTS[s.kind])) {
      for (const [label, read] of series) {
        const key = title + "/" + label;
        const column = h.values[key] || (h.values[key] = new Array(h.t.length - 1).fill(null));
        const value = read(s.figures, doc.stats.server);
        column.push(value === undefined ? null : value);
      }
    }
    if (h.t.length > HISTORY) {
      h.t.shift();
      for (const column of Object.values(h.values)) column.shift();
    }
  }
}

// ---- rendering -----------------------------------------------------------------

function render(doc) {
  state.latest = doc;
  record(doc);
  renderServer(doc);
  renderModels(doc);
  renderSubjects(doc);
  renderCharts();
  renderRoutes(doc);
  renderChatModels(doc);
  $("window").textContent = doc.stats.window_s ? doc.stats.window_s.toFixed(0) + " s" : "(first sample)";
}

function renderServer(doc) {
  const status = doc.server.draining ? "draining" : doc.server.ready ? "ready" : "not ready";
  $("server-status").textContent = status;
  $("server-status").className = "pill " + (doc.server.ready ? "ready" : "unavailable");
  const price = doc.server.price_per_hour_usd;
  $("server-info").textContent = "version " + doc.server.version + (price !== null ? " | $" + price + "/hour" : "");
}

function fmt(v, digits) {
  return v === null || v === undefined ? "-" : Number(v).toFixed(digits === undefined ? 1 : digits);
}

function cell(row, text, className) {
  const td = document.createElement("td");
  if (text instanceof Node) td.appendChild(text); else td.textContent = text;
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function renderModels(doc) {
  const body = $("models").querySelector("tbody");
  body.replaceChildren();
  for (const m of doc.models) {
    const f = doc.stats.models[m.name] || {};
    const row = document.createElement("tr");
    row.dataset.model = m.name;
    cell(row, m.name);
    cell(row, m.backend + (m.command_line ? " (command line)" : ""));
    const pill = document.createElement("span");
    pill.className = "pill " + m.state;
    pill.textContent = m.state;
    pill.title = m.reason || "";
    cell(row, pill).classList.add("state");
    cell(row, m.versions.join(", ") || "-");
    cell(row, fmt(f.request_rate));
    cell(row, fmt(q(f.latency_ms, "p99")));
    cell(row, fmt(f.queue_length, 0));
    cell(row, fmt(f.cost_per_1k_usd, 5));
    const actions = cell(row, "");
    if (doc.server.model_control) {
      for (const action of ["load", "unload"]) {
        const button = document.createElement("button");
        button.type = "button";
        button.textContent = action === "load" ? (m.state === "ready" ? "Reload" : "Load") : "Unload";
        button.dataset.action = action;
        button.disabled = action === "unload" && m.state !== "ready";
        button.addEventListener("click", () => control(m.name, action));
        actions.appendChild(button);
      }
    }
    body.appendChild(row);
  }
}

async function control(name, action) {
  const message = $("control-message");
  message.className = "";
  message.textContent = (action === "load" ? "loading " : "unloading ") + name + "...";
  const response = await api("/v2/repository/models/" + encodeURIComponent(name) + "/" + action, {
    method: "POST", headers: {"Content-Type": "application/json"}, body: "{}",
  });
  if (response.ok) {
    message.textContent = name + ": " + (action === "load" ? "loaded" : "unloaded");
  } else {
    message.className = "error";
    message.textContent = name + ": " + action + " failed: " + (await errorText(response));
  }
  await poll();
}

function renderSubjects(doc) {
  const select = $("subject");
  const list = subjects(doc);
  const ids = list.map((s) => s.id).join("|");
  if (select.dataset.ids !== ids) {
    select.replaceChildren();
    for (const s of list) {
      const option = document.createElement("option");
      option.value = s.id;
      option.textContent = s.label;
      select.appendChild(option);
    }
    select.dataset.ids = ids;
  }
  if (!list.some((s) => s.id === state.subject)) state.subject = list.length ? list[0].id : null;
  select.value = state.subject || "";
}

$("subject").addEventListener("change", (event) => {
  state.subject = event.target.value;
  destroyCharts();
  renderCharts();
});

function destroyCharts() {
  for (const chart of Object.values(state.charts)) chart.destroy();
  state.charts = {};
  $("charts").replaceChildren();
}

function renderCharts() {
  const h = state.history[state.subject];
  if (!h) { destroyCharts(); return; }
  const spec = CHARTS[h.kind];
  if (Object.keys(state.charts).some((title) => !(title in spec))) destroyCharts();
  const width = Math.max(360, Math.min(560, $("charts").clientWidth / 2 - 20));
  for (const [title, series] of Object.entries(spec)) {
    const data = [h.t.slice()].concat(series.map(([label]) => (h.values[title + "/" + label] || []).slice()));
    let chart = state.charts[title];
    if (!chart) {
      const box = document.createElement("div");
      box.className = "chart";
      box.dataset.title = title;
      $("charts").appendChild(box);
      chart = new uPlot({
        title: title, width: width, height: 190,
        scales: {x: {time: true}},
        axes: [{}, {size: 56}],
        series: [{}].concat(series.map(([label], i) => ({
          label: label, stroke: COLORS[i % COLORS.length], width: 1.5, points: {show: false},
        }))),
      }, data, box);
      state.charts[title] = chart;
    } else {
      chart.setData(data);
    }
  }
}

function renderRoutes(doc) {
  const box = $("routes");
  box.replaceChildren();
  if (!doc.routes.length) {
    const p = document.createElement("p");
    p.className = "hint";
    p.textContent = "No routes.";
    box.appendChild(p);
    return;
  }
  const table = document.createElement("table");
  const head = document.createElement("tr");
  for (const h of ["route", "target", "weight", "share", "", "req/s", "p99 ms", "canary"]) cell(head, h);
  table.appendChild(head);
  for (const route of doc.routes) {
    for (const target of route.targets) {
      const f = (doc.stats.routes[route.name] || {})[target.target] || {};
      const row = document.createElement("tr");
      row.dataset.route = route.name;
      cell(row, route.name);
      cell(row, target.target);
      cell(row, fmt(target.weight, 1));
      cell(row, fmt(100 * target.share, 1) + "%");
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.style.width = (100 * target.share).toFixed(1) + "%";
      bar.appendChild(fill);
      cell(row, bar);
      cell(row, fmt(f.request_rate));
      cell(row, fmt(q(f.latency_ms, "p99")));
      const canary = route.canary && route.canary.target === target.target ? route.canary.state : "";
      cell(row, canary);
      table.appendChild(row);
    }
  }
  box.appendChild(table);
}

// ---- chat playground -------------------------------------------------------------

function renderChatModels(doc) {
  const select = $("chat-model");
  const names = doc.chat_models.join("|");
  if (select.dataset.names === names) return;
  const chosen = select.value;
  select.replaceChildren();
  for (const name of doc.chat_models) {
    const option = document.createElement("option");
    option.value = option.textContent = name;
    select.appendChild(option);
  }
  select.dataset.names = names;
  if (doc.chat_models.includes(chosen)) select.value = chosen;
  $("playground").hidden = doc.chat_models.length === 0;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

$("chat-reset").addEventListener("click", () => {
  state.chat = [];
  $("chat-log").replaceChildren();
  $("chat-status").textContent = "";
});

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  state.chat.push({role: "user", content: text});
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.dataset.chunks = "0";
  await streamChat(out);
});

async function streamChat(out) {
  const status = $("chat-status");
  status.className = "";
  status.dataset.state = "streaming";
  status.textContent = "waiting for the first token...";
  $("chat-send").disabled = true;
  const started = performance.now();
  let first = null, chunks = 0, tokens = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({
        model: $("chat-model").value, messages: state.chat, stream: true,
        stream_options: {include_usage: true}, max_tokens: Number($("chat-max-tokens").value) || 64,
      }),
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline).trim();
        buffer = buffer.slice(newline + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (first === null) first = performance.now();
          out.textContent += delta.content;
          chunks += 1;
          out.dataset.chunks = String(chunks);
          status.textContent = "streaming: " + chunks + " chunks";
        }
      }
    }
    state.chat.push({role: "assistant", content: out.textContent});
    const seconds = (performance.now() - started) / 1000;
    const ttft = first === null ? "-" : ((first - started)).toFixed(0) + " ms";
    status.textContent = "done: " + chunks + " chunks" + (tokens !== null ? ", " + tokens + " tokens" : "") +
      ", first token after " + ttft + ", " + seconds.toFixed(2) + " s in all";
    status.dataset.state = "done";
  } catch (e) {
    status.className = "error";
    status.textContent = "chat failed: " + e.message;
    status.dataset.state = "failed";
    state.chat.pop();
  } finally {
    $("chat-send").disabled = false;
  }
}

window.kilnDashboard = state; // for people poking at it in the console (and the browser tests)
start();
