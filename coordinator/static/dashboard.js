// The swarm dashboard: polls /api/status and draws everything with the DOM and inline SVG.
// Every value from the API is written with textContent or setAttribute, never parsed as HTML.
"use strict";

const POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";

function $(id) { return document.getElementById(id); }

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined || !isFinite(value)) return "–";
  return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function compact(value) {
  if (!isFinite(value)) return "–";
  const abs = Math.abs(value);
  if (abs >= 1e9) return (value / 1e9).toFixed(1) + "G";
  if (abs >= 1e6) return (value / 1e6).toFixed(1) + "M";
  if (abs >= 1e4) return (value / 1e3).toFixed(1) + "k";
  return fmt(value, abs < 10 && value % 1 ? 2 : 0);
}

function ago(seconds) {
  if (seconds < 1) return "now";
  if (seconds < 90) return Math.round(seconds) + " s ago";
  if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
  if (seconds < 172800) return Math.round(seconds / 3600) + " h ago";
  return Math.round(seconds / 86400) + " d ago";
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

function niceTicks(lo, hi, count) {
  if (hi <= lo) { hi = lo + 1; }
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(v);
  return ticks;
}

// series: [{cls, points: [[t, y], ...]}]; draws axes, grid and one polyline per series.
function drawChart(svg, series, options) {
  const width = Math.max(svg.clientWidth || 600, 200), height = 220;
  const pad = { left: 48, right: 12, top: 10, bottom: 24 };
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const all = series.flatMap((s) => s.points);
  svg.dataset.points = String(all.length);
  if (all.length === 0) {
    svg.appendChild(svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "nodata" },
      options.empty || "no data yet"));
    return;
  }
  const ts = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let t0 = Math.min(...ts), t1 = Math.max(...ts);
  if (t1 - t0 < 1) { t0 -= 1; t1 += 1; }
  let y0 = options.zero ? 0 : Math.min(...ys), y1 = Math.max(...ys);
  if (y1 - y0 < 1e-9) { y1 += options.zero ? 1 : 0.5; y0 -= options.zero ? 0 : 0.5; }
  const span = y1 - y0;
  if (!options.zero) y0 -= span * 0.05;
  y1 += span * 0.05;
  const x = (t) => pad.left + ((t - t0) / (t1 - t0)) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - ((v - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);
  for (const v of niceTicks(y0, y1, 4)) {
    if (v < y0 || v > y1) continue;
    svg.appendChild(svgEl("line", { x1: pad.left, x2: width - pad.right, y1: y(v), y2: y(v), class: "grid" }));
    svg.appendChild(svgEl("text", { x: pad.left - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" },
      options.integer ? fmt(v, 0) : compact(v)));
  }
  const xticks = Math.max(2, Math.min(5, Math.floor(width / 140)));
  for (let i = 0; i <= xticks; i++) {
    const t = t0 + ((t1 - t0) * i) / xticks;
    const anchor = i === 0 ? "start" : i === xticks ? "end" : "middle";
    svg.appendChild(svgEl("text", { x: x(t), y: height - 6, "text-anchor": anchor, class: "tick" }, clock(t)));
  }
  for (const s of series) {
    if (s.points.length === 0) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    if (s.area) {
      const last = s.points[s.points.length - 1], first = s.points[0];
      svg.appendChild(svgEl("path", { d: `${d} L${x(last[0]).toFixed(1)},${y(y0)} L${x(first[0]).toFixed(1)},${y(y0)} Z`, class: "area" }));
    }
    svg.appendChild(svgEl("path", { d, class: `line ${s.cls}`, "data-series": s.cls, "data-count": s.points.length }));
    if (s.points.length === 1) {
      const p = s.points[0];
      svg.appendChild(svgEl("circle", { cx: x(p[0]), cy: y(p[1]), r: 3, class: `dot ${s.cls}` }));
    }
  }
}

function fillTable(id, rows, emptyId) {
  const body = $(id).querySelector("tbody");
  body.replaceChildren(...rows);
  $(emptyId).hidden = rows.length > 0;
  $(id).hidden = rows.length === 0;
}

function stateBadge(peer) {
  const wrap = el("span");
  const state = peer.paused ? "paused" : peer.state;
  wrap.appendChild(el("span", { class: `badge ${state}` }, state));
  if (peer.diverged) wrap.appendChild(el("span", { class: "badge diverged", title: "its parameters differ from most peers at its step, or its progress does not reach the coordinator's DHT (a split swarm)" }, "diverged"));
  if (peer.suspected_by > 0) {
    wrap.appendChild(el("span", {
      class: "badge suspected",
      title: `${peer.suspected_by} online peer(s) avoid it for breaking their rounds (a part never delivered, a round denied); not provable, so not a ban`,
    }, `avoided by ${peer.suspected_by}`));
  }
  return wrap;
}

function shortId(id) { return id.length > 16 ? `${id.slice(0, 8)}…${id.slice(-6)}` : id; }

function render(s) {
  $("run-id").textContent = `run ${s.run_id}`;
  $("run-sub").textContent = `model ${s.run.model} · dataset ${s.run.dataset} · target batch ${s.run.target_batch_size} · ` +
    `aggregator ${s.run.aggregator} · admission ${s.run.admission} · coordinator ${shortId(s.coordinator_peer_id)}`;
  $("kpi-step").textContent = fmt(s.step, 0);
  const outer = s.run.sync === "diloco" ? ` outer steps (${fmt(s.run.inner_steps, 0)} local steps each)` : "";
  const limit = s.run.max_steps ? `of ${fmt(s.run.max_steps, 0)}` : "no step limit";
  $("kpi-step-hint").textContent = s.finished
    ? `run finished: final checkpoint at step ${fmt(s.finished_step, 0)}` + outer
    : limit + outer;
  $("kpi-train").textContent = fmt(s.train_loss, 3);
  $("kpi-val").textContent = s.val_loss === null ? "validation: –" : `validation: ${fmt(s.val_loss, 3)}`;
  $("kpi-sps").textContent = compact(s.samples_per_s);
  $("kpi-peers").textContent = fmt(s.peers_online, 0);
  $("kpi-peers-hint").textContent = `${s.peers.length} known · ${s.peers_paused} paused · ${s.bans.length} banned`;
  $("kpi-credit").textContent = compact(s.contributed_samples);

  const h = s.history;
  const pick = (key) => h.filter((p) => p[key] !== null).map((p) => [p.t, p[key]]);
  drawChart($("chart-loss"), [{ cls: "train", points: pick("train_loss") }, { cls: "val", points: pick("val_loss") }],
    { empty: "no loss reported yet" });
  drawChart($("chart-sps"), [{ cls: "main", points: pick("samples_per_s"), area: true }], { zero: true });
  drawChart($("chart-peers"), [{ cls: "main", points: pick("peers_online"), area: true }], { zero: true, integer: true });

  const now = s.server_time;
  // A peer's measured uplink, and whether others can dial it (behind NAT it reduces no part: docs/wan.md).
  const linkCell = (m) => {
    const rate = m.uplink_mbit === undefined ? "–" : `${fmt(m.uplink_mbit, 1)} Mbit/s`;
    if (m.dialable !== 0) return el("td", {}, rate);
    return el("td", { title: "behind NAT: averages over connections it opens, reduces no part, never leads a group" },
      `${rate} · behind NAT`);
  };

  fillTable("peers", s.peers.map((p) => {
    const row = el("tr", { "data-peer-id": p.peer_id, "data-state": p.paused ? "paused" : p.state });
    row.appendChild(el("td", {}, p.name));
    row.appendChild(el("td", { class: "mono", title: p.peer_id }, shortId(p.peer_id)));
    row.appendChild(el("td", {}, p.role));
    const peak = p.metrics.peak_memory_bytes;  // GPU tensors, or the process's RSS on a CPU peer
    row.appendChild(el("td", {}, peak ? `${p.device} · peak ${(peak / 2 ** 30).toFixed(1)} GiB` : p.device));
    const state = el("td"); state.appendChild(stateBadge(p)); row.appendChild(state);
    row.appendChild(el("td", { class: "num" }, fmt(p.step, 0)));
    row.appendChild(el("td", { class: "num" }, p.state === "online" && !p.paused ? fmt(p.samples_per_s, 1) : "–"));
    row.appendChild(el("td", { class: "num" }, fmt(p.contributed_samples, 0)));
    row.appendChild(linkCell(p.metrics));
    row.appendChild(el("td", { class: "num" }, ago(Math.max(0, now - p.last_seen))));
    return row;
  }), "peers-empty");

  fillTable("leaderboard", s.leaderboard.map((e) => {
    const row = el("tr");
    row.appendChild(el("td", { class: "num" }, e.rank));
    row.appendChild(el("td", { title: e.peer_id }, e.name));
    row.appendChild(el("td", { class: "num" }, fmt(e.contributed_samples, 0)));
    const share = el("td");
    const bar = el("span", { class: "share" });
    bar.style.width = `${Math.max(2, Math.round(e.share * 120))}px`; // CSSOM: the page's CSP forbids style attributes
    share.appendChild(bar);
    share.appendChild(document.createTextNode(`${fmt(e.share * 100, 1)}%`));
    row.appendChild(share);
    return row;
  }), "leaderboard-empty");

  fillTable("bans", s.bans.map((b) => {
    const row = el("tr");
    row.appendChild(el("td", { class: "mono", title: b.peer_id }, b.name || shortId(b.peer_id)));
    row.appendChild(el("td", {}, b.reason));
    row.appendChild(el("td", {}, ago(Math.max(0, now - b.banned_at))));
    const evidence = el("td");
    if (b.evidence) {
      const details = el("details");
      details.appendChild(el("summary", {}, `${fmt(b.evidence.bytes, 0)} bytes (${b.evidence.kind})`));
      details.appendChild(el("pre", {}, b.evidence.preview + (b.evidence.truncated ? " …" : "")));
      evidence.appendChild(details);
    } else {
      evidence.textContent = "none recorded";
    }
    row.appendChild(evidence);
    return row;
  }), "bans-empty");
}

async function poll() {
  try {
    const response = await fetch("/api/status", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    $("conn").dataset.ok = "1";
    $("conn").textContent = `live · updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.loaded = "1";
  } catch (error) {
    $("conn").dataset.ok = "0";
    $("conn").textContent = `coordinator unreachable (${error.message}); retrying`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
