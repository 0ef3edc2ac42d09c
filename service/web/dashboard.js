// The Plimsoll dashboard: the live pressure stream (api/watch, Server-Sent Events)
// drives the level, the figures, the chart and the event list; api/status fills in
// the models. Everything is drawn here, on a <canvas>: the page loads nothing else.
"use strict";

const HISTORY_MS = 10 * 60 * 1000; // the chart's widest window
const MIN_WINDOW_MS = 15 * 1000; // and its narrowest
const MAX_POINTS = 4000;
const MAX_EVENTS = 200;
const STATUS_EVERY_MS = 2000;
const RECONNECT_MS = 2000; // after the browser gave up (an error answer, not a drop)
const COLOURS = {
  ok: "#2e9d4f", soft: "#d9a400", hard: "#e0611a", emergency: "#c8102e",
  unknown: "#7a7a7a", usage: "#1f4e9c", grid: "#e3e7ee", text: "#5d6677",
};
const BAND_ALPHA = 0.13;
// The governor walks these caps one step per tick: one row per walk.
const CAP_KINDS = new Set(["ENFORCER_ACTION_KIND_BATCH_CAP", "ENFORCER_ACTION_KIND_STORE_CACHE_CAP"]);

const state = {
  points: [], // {t, level, usage, soft, hard, ceiling}
  events: [], // newest first
  seen: new Set(), // sequences listed already (a replay repeats them)
  rows: new Map(), // kind/model/reason → the latest row of that action
  epoch: 0, // transitions seen: a cap walk's row ends at the next one
  lastSeq: 0,
  instance: "", // the server process that numbered lastSeq
  level: "unknown",
  skewMs: 0, // server clock minus ours
  statusBusy: false,
  statusTimer: 0,
};

const $ = (id) => document.getElementById(id);
const num = (v) => (v === undefined || v === null || v === "" ? 0 : Number(v));
const strip = (name, prefix) => (name || "").replace(prefix, "").toLowerCase();
const levelOf = (name) => strip(name, "PRESSURE_LEVEL_") || "unknown";

function bytes(n) {
  const v = num(n);
  if (v >= 2 ** 30) return (v / 2 ** 30).toFixed(v >= 100 * 2 ** 30 ? 0 : 2) + " GiB";
  if (v >= 2 ** 20) return (v / 2 ** 20).toFixed(v >= 100 * 2 ** 20 ? 0 : 1) + " MiB";
  if (v >= 2 ** 10) return (v / 2 ** 10).toFixed(0) + " KiB";
  return v.toFixed(0) + " B";
}

function parseTime(ts) {
  if (!ts) return Date.now() + state.skewMs;
  // RFC 3339 with up to nanoseconds: keep milliseconds, which every Date parses.
  return Date.parse(ts.replace(/(\.\d{3})\d+/, "$1"));
}

function clock(t) {
  const d = new Date(t - state.skewMs);
  return d.toTimeString().slice(0, 8);
}

function text(id, value) {
  const el = $(id);
  if (el) el.textContent = value;
}

function el(tag, cls, content) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (content !== undefined) node.textContent = content;
  return node;
}

// -- the level and the figures -------------------------------------------------------

function setLevel(level) {
  state.level = level;
  const badge = $("level");
  badge.textContent = level.toUpperCase();
  badge.className = "level level-" + level;
  document.body.dataset.level = level;
  document.title = "Plimsoll: " + level.toUpperCase();
}

function showFigures(readings, limits, admission) {
  if (readings) {
    const usage = num(readings.processBytes);
    text("f-usage", bytes(usage));
    text("f-pool", bytes(readings.mlxPoolBytes));
    if (limits && num(limits.ceilingBytes)) {
      const pct = ((100 * usage) / num(limits.ceilingBytes)).toFixed(0);
      text("usage-line", `${bytes(usage)} of ${bytes(limits.ceilingBytes)} (${pct}% of the ceiling)`);
    }
  }
  if (limits) {
    text("f-soft", bytes(limits.softBytes));
    text("f-hard", bytes(limits.hardBytes));
    text("f-ceiling", bytes(limits.ceilingBytes));
    text("f-admission-limit", bytes(limits.admissionLimitBytes));
    text("f-binding", strip(limits.bindingTerm, "CEILING_TERM_") || "–");
    text("f-tier", strip(limits.tier, "MEMORY_GUARD_TIER_") || "–");
  }
  if (admission) {
    text("f-bank", bytes(admission.sessionBankBytes));
    text("f-reservations", `${num(admission.reservations)} · ${bytes(admission.reservedBytes)}`);
    text("f-queue", `${num(admission.running)} / ${num(admission.waiting)}`);
    text("f-admission", admission.draining ? "draining" : admission.paused ? "paused" : "open");
  }
}

function addPoint(t, level, readings, limits) {
  if (!readings || !limits) return;
  const p = {
    t, level,
    usage: num(readings.processBytes),
    soft: num(limits.softBytes),
    hard: num(limits.hardBytes),
    ceiling: num(limits.ceilingBytes),
  };
  const pts = state.points;
  let i = pts.length;
  while (i > 0 && pts[i - 1].t > t) i--; // a replayed event lands in its place
  pts.splice(i, 0, p);
  const oldest = t - HISTORY_MS;
  while (pts.length > MAX_POINTS || (pts.length > 1 && pts[0].t < oldest)) pts.shift();
  draw();
}

// -- events ---------------------------------------------------------------------------

function addEvent(seq, item) {
  if (state.seen.has(seq)) return;
  state.seen.add(seq);
  item.seqs = [seq];
  state.events.unshift(item);
  settleEvents();
}

function settleEvents() {
  state.events.sort((a, b) => b.seq - a.seq);
  while (state.events.length > MAX_EVENTS) {
    for (const seq of state.events.pop().seqs) state.seen.delete(seq);
  }
  renderEvents();
}

function renderEvents() {
  const list = $("events");
  list.replaceChildren();
  if (!state.events.length) {
    list.append(el("li", "empty", "none since this page opened"));
    return;
  }
  for (const e of state.events) {
    const li = el("li", `event ${e.kind}` + (e.to ? ` to-${e.to}` : "") + (e.replayed ? " replayed" : ""));
    li.dataset.seq = String(e.seq);
    li.append(el("span", "time", clock(e.t)), el("span", "what", e.what));
    const detail = el("span", "detail", e.detail);
    if (e.note) detail.append(" ", el("small", "", e.note));
    li.append(detail);
    list.append(li);
  }
}

// Why a level was entered, in the marks' terms.
function cause(to, readings, limits) {
  const usage = "usage " + bytes(num(readings && readings.processBytes));
  const mark = (name, key) => `${name} ${bytes(num(limits && limits[key]))}`;
  if (to === "ok") return `${usage} < ${mark("soft", "softBytes")}`;
  if (to === "soft") return `${usage} ≥ ${mark("soft", "softBytes")}`;
  if (to === "hard") return `${usage} ≥ ${mark("hard", "hardBytes")}`;
  if (to === "emergency") return `${usage} over ${mark("the ceiling", "ceilingBytes")}`;
  return usage;
}

function onTransition(msg, t) {
  const tr = msg.transition;
  const from = levelOf(tr.fromLevel);
  const to = levelOf(tr.toLevel);
  const why = cause(to, tr.readings, tr.limits);
  state.epoch += 1;
  addEvent(num(msg.sequence), {
    seq: num(msg.sequence), t, kind: "transition", to,
    what: `${from} → ${to}`,
    detail: why,
    note: (tr.reason ? `(${tr.reason})` : "") + (msg.replayed ? " (replayed)" : ""),
    replayed: msg.replayed,
  });
  if (!msg.replayed) {
    setLevel(to);
    text("reason", `${from} → ${to} at ${clock(t)}: ${why}`);
    showFigures(tr.readings, tr.limits, null);
  }
  addPoint(t, to, tr.readings, tr.limits);
  refreshStatus();
}

// An action that repeats a row (the same kind, model and reason, or the next step of
// a cap walk) with no transition since joins that row, counted, instead of a new one.
function onAction(msg, t) {
  const a = msg.action;
  const seq = num(msg.sequence);
  if (state.seen.has(seq)) return;
  const cap = CAP_KINDS.has(a.kind);
  const value = cap ? (a.reason || "").replace(/^cap /, "") : "";
  const key = [a.kind, a.modelId || "", cap ? "" : a.reason || ""].join("/");
  const row = state.rows.get(key);
  if (row && row.epoch === state.epoch && state.events.includes(row)) {
    state.seen.add(seq);
    row.seqs.push(seq);
    row.seq = Math.max(row.seq, seq);
    row.t = Math.max(row.t, t);
    tally(row, a);
    describe(row, a, value);
    settleEvents();
  } else {
    const fresh = {
      seq, t, kind: "action", what: strip(a.kind, "ENFORCER_ACTION_KIND_").replaceAll("_", " "),
      epoch: state.epoch, from: value, count: 0, freed: 0, entries: 0, requests: 0,
      replayed: msg.replayed,
    };
    tally(fresh, a);
    describe(fresh, a, value);
    state.rows.set(key, fresh);
    addEvent(seq, fresh);
  }
  refreshStatus();
}

function tally(row, a) {
  row.count += 1;
  row.freed += num(a.bytesFreed);
  row.entries += num(a.entriesEvicted);
  row.requests += (a.requestIds || []).length;
}

function describe(row, a, value) {
  const bits = [];
  if (row.from) bits.push(`cap ${row.from}` + (value !== row.from ? ` → ${value}` : ""));
  else if (a.reason) bits.push(a.reason);
  if (a.modelId) bits.push(a.modelId);
  if (row.freed) bits.push("freed " + bytes(row.freed));
  if (row.entries) bits.push(`${row.entries} entries`);
  if (row.requests) bits.push(`${row.requests} request(s)`);
  row.detail = bits.join(" · ");
  row.note = `at ${levelOf(a.level)}` + (row.count > 1 ? `, ×${row.count}` : "")
    + (row.replayed ? " (replayed)" : "");
}

// -- the stream -----------------------------------------------------------------------

function handle(kind, event) {
  const msg = JSON.parse(event.data);
  const seq = num(msg.sequence);
  const t = parseTime(msg.eventTime);
  if (!msg.replayed && msg.eventTime) state.skewMs = t - Date.now();
  if (kind === "snapshot") {
    // A new server process: another instance (or, from a server that names none, a lower
    // sequence: numbers start again in a new process).
    const restarted = msg.instance && state.instance ? msg.instance !== state.instance
      : seq < state.lastSeq;
    if (restarted) state.seen.clear();
    state.lastSeq = seq;
    state.instance = msg.instance || "";
    const s = msg.snapshot;
    setLevel(levelOf(s.level));
    showFigures(s.readings, s.limits, s.admission);
    addPoint(t, levelOf(s.level), s.readings, s.limits);
    text("footer-status", restarted ? `server restarted at ${clock(t)}`
      : s.replayIncomplete ? "some events were missed while disconnected" : "");
    refreshStatus();
    return;
  }
  state.lastSeq = Math.max(state.lastSeq, seq);
  if (kind === "sample") {
    const s = msg.sample;
    setLevel(levelOf(s.level));
    showFigures(s.readings, s.limits, s.admission);
    addPoint(t, levelOf(s.level), s.readings, s.limits);
  } else if (kind === "transition") {
    onTransition(msg, t);
  } else if (kind === "action") {
    onAction(msg, t);
  }
}

function connection(word, cls) {
  const c = $("conn");
  c.textContent = word;
  c.className = "conn conn-" + cls;
}

function connect() {
  // The browser's own reconnects send Last-Event-ID; a fresh EventSource says it here.
  const url = "api/watch" + (state.lastSeq ? "?last_event_id=" + state.lastSeq
    + (state.instance ? "&instance=" + encodeURIComponent(state.instance) : "") : "");
  const source = new EventSource(url);
  for (const kind of ["snapshot", "transition", "sample", "action"]) {
    source.addEventListener(kind, (e) => handle(kind, e));
  }
  source.addEventListener("overflow", () => connection("fell behind: catching up", "reconnecting"));
  source.onopen = () => connection("live", "live");
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED) {
      connection("disconnected: retrying", "down");
      setTimeout(connect, RECONNECT_MS);
    } else {
      connection("reconnecting", "reconnecting");
    }
  };
}

// -- the models (api/status) ----------------------------------------------------------

async function refreshStatus() {
  if (state.statusBusy) return;
  state.statusBusy = true;
  clearTimeout(state.statusTimer);
  try {
    const resp = await fetch("api/status", { cache: "no-store" });
    if (resp.ok) showStatus(await resp.json());
  } catch (err) {
    // The stream's own state says whether the server is there.
  } finally {
    state.statusBusy = false;
    state.statusTimer = setTimeout(refreshStatus, STATUS_EVERY_MS);
  }
}

function showStatus(st) {
  showFigures(null, null, st.admission);
  if (!st.enforcerEnabled) text("reason", "the enforcer is off");
  const owners = {};
  for (const lease of st.leases || []) {
    if (lease.modelId) (owners[lease.modelId] ||= []).push(lease.owner || "?");
  }
  const body = $("models").tBodies[0];
  body.replaceChildren();
  if (!(st.models || []).length) {
    const tr = el("tr");
    const td = el("td", "empty", "no model loaded");
    td.colSpan = 7;
    tr.append(td);
    body.append(tr);
  }
  for (const m of st.models || []) {
    const tr = el("tr");
    const st8 = strip(m.state, "MODEL_STATE_");
    const pins = el("td");
    if (m.pinned) pins.append(el("span", "pin", "pinned" + (owners[m.modelId] ? ": " + owners[m.modelId].join(", ") : "")));
    tr.append(
      el("td", "", m.modelId + (m.isDefault ? " *" : "")),
      el("td", "state state-" + st8, st8),
      pins,
      el("td", "num", num(m.measuredBytes) ? bytes(m.measuredBytes) : "–"),
      el("td", "num", `${num(m.activeRequests)} / ${num(m.waitingRequests)}`),
      el("td", "num", String(num(m.batchCap))),
      el("td", "", m.pendingUnload || ""),
    );
    body.append(tr);
  }
  const sessions = (st.leases || []).filter((l) => l.sessionId).length;
  text("leases", `${(st.leases || []).length} lease(s)` + (sessions ? `, ${sessions} on sessions` : "") + " · * the default model");
}

// -- the chart ------------------------------------------------------------------------

function niceStep(max, ticks) {
  const raw = max / ticks;
  const mag = 2 ** Math.floor(Math.log2(raw));
  for (const m of [1, 2, 4, 8]) if (mag * m >= raw) return mag * m;
  return mag * 16;
}

function draw() {
  const canvas = $("chart");
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (!w || !h) return;
  const dpr = window.devicePixelRatio || 1;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const pts = state.points;
  const left = 70, right = 112, top = 8, strip = 10, bottom = 22 + strip;
  const pw = w - left - right, ph = h - top - bottom;
  ctx.font = "11px system-ui, sans-serif";
  if (!pts.length) {
    ctx.fillStyle = COLOURS.text;
    ctx.fillText("waiting for readings…", left + 8, top + 20);
    return;
  }
  const now = Math.max(Date.now() + state.skewMs, pts[pts.length - 1].t);
  const span = Math.min(HISTORY_MS, Math.max(MIN_WINDOW_MS, now - pts[0].t));
  const t0 = now - span;
  let ymax = 0;
  for (const p of pts) ymax = Math.max(ymax, p.usage, p.ceiling);
  ymax = (ymax || 1) * 1.08;
  const x = (t) => left + ((t - t0) / span) * pw;
  const y = (b) => top + ph - (b / ymax) * ph;
  const segments = pts.map((p, i) => [p, Math.max(t0, p.t), i + 1 < pts.length ? pts[i + 1].t : now])
    .filter(([, a, b]) => b > t0 && b >= a);

  // Bands: ok below soft, soft to hard, hard to the ceiling, emergency above.
  ctx.globalAlpha = BAND_ALPHA;
  for (const [p, a, b] of segments) {
    const x0 = x(a), x1 = x(b);
    const zones = [[0, p.soft, "ok"], [p.soft, p.hard, "soft"], [p.hard, p.ceiling, "hard"], [p.ceiling, ymax, "emergency"]];
    for (const [lo, hi, lvl] of zones) {
      ctx.fillStyle = COLOURS[lvl];
      ctx.fillRect(x0, y(hi), x1 - x0 + 0.5, y(lo) - y(hi));
    }
  }
  ctx.globalAlpha = 1;

  // Grid and byte labels.
  const step = niceStep(ymax, 5);
  ctx.strokeStyle = COLOURS.grid;
  ctx.fillStyle = COLOURS.text;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let b = 0; b <= ymax; b += step) {
    ctx.beginPath();
    ctx.moveTo(left, Math.round(y(b)) + 0.5);
    ctx.lineTo(left + pw, Math.round(y(b)) + 0.5);
    ctx.stroke();
    ctx.fillText(bytes(b), left - 6, y(b));
  }
  // Time labels.
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const tick = [1, 2, 5, 10, 15, 30, 60, 120].map((s) => s * 1000).find((s) => span / s <= 8) || 300000;
  for (let t = Math.ceil(t0 / tick) * tick; t <= now; t += tick) {
    ctx.fillText(clock(t), x(t), top + ph + strip + 6);
  }

  // The marks, stepped as they move, each labelled at its right end.
  const last = pts[pts.length - 1];
  const marks = [["soft", "soft", [6, 4]], ["hard", "hard", [6, 4]], ["ceiling", "emergency", [2, 0]]];
  ctx.lineWidth = 1.5;
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  for (const [key, colour, dash] of marks) {
    ctx.strokeStyle = COLOURS[colour];
    ctx.setLineDash(dash);
    ctx.beginPath();
    segments.forEach(([p, a, b], i) => {
      if (i === 0) ctx.moveTo(x(a), y(p[key]));
      else ctx.lineTo(x(a), y(p[key]));
      ctx.lineTo(x(b), y(p[key]));
    });
    ctx.stroke();
    ctx.fillStyle = COLOURS[colour];
    ctx.fillText(`${key} ${bytes(last[key])}`, left + pw + 6, y(last[key]));
  }
  ctx.setLineDash([]);

  // Usage, as measured at each tick.
  ctx.strokeStyle = COLOURS.usage;
  ctx.lineWidth = 2.5;
  ctx.lineJoin = "round";
  ctx.beginPath();
  segments.forEach(([p, a, b], i) => {
    if (i === 0) ctx.moveTo(x(a), y(p.usage));
    else ctx.lineTo(x(a), y(p.usage));
    if (i === segments.length - 1) ctx.lineTo(x(b), y(p.usage));
  });
  ctx.stroke();

  // The level over time, a strip under the plot.
  for (const [p, a, b] of segments) {
    ctx.fillStyle = COLOURS[p.level] || COLOURS.unknown;
    ctx.fillRect(x(a), top + ph + 2, x(b) - x(a) + 0.5, strip - 2);
  }
  ctx.strokeStyle = COLOURS.text;
  ctx.lineWidth = 1;
  ctx.strokeRect(left + 0.5, top + 0.5, pw, ph);
}

window.addEventListener("resize", draw);
setInterval(draw, 1000); // time moves on between samples
connect();
refreshStatus();
