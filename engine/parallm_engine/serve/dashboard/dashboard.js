// ParaLLM's live page: renders /v1/status/stream (server-sent events). Plain DOM, no build step; every
// text from the engine goes in with textContent (a prompt may hold markup).
"use strict";

const MAX_WINDOW_S = 60;  // the timeline's width in seconds at most (at least 10: it fits what it shows)
const MAX_LANES = 40;     // the most recent lanes shown
const MAX_CHILDREN = 6;   // a tree node's children shown (the most used first); the rest counted
const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function ms(s) { return s === null || s === undefined ? "-" : (1000 * s).toFixed(0) + " ms"; }

// -- the batch now ---------------------------------------------------------------------------------
function renderBatch(rows) {
  const body = $("batch").tBodies[0];
  body.replaceChildren();
  for (const r of rows) {
    const tr = el("tr", "row phase-" + r.phase);
    tr.dataset.id = r.id;
    tr.dataset.phase = r.phase;
    const cells = [r.index ? r.id + "/" + r.index : r.id, r.program || "-", r.phase,
      r.queue_position === null ? "" : r.queue_position, r.tokens_per_s.toFixed(1), r.pages,
      r.cached_tokens, r.generated_tokens, r.pinned ? "pinned" : ""];
    cells.forEach((c, i) => tr.appendChild(el("td", i >= 3 && i <= 7 ? "num" : "", c)));
    body.appendChild(tr);
  }
  const by = (p) => rows.filter((r) => r.phase === p).length;
  $("batch-count").textContent = rows.length ? `${by("decode")} decoding, ${by("prefill")} prefilling, ` +
    `${by("queued")} queued` : "idle";
}

// -- memory ---------------------------------------------------------------------------------------
function renderMemory(e) {
  const box = $("memory");
  box.replaceChildren();
  const budget = e.kv_budget_bytes || 0;
  const line = (name, value, of, note) => {
    const row = el("div", "mem-row");
    row.dataset.name = name;
    row.appendChild(el("span", "", name));
    const bar = el("div", "mem-bar"), fill = el("div");
    fill.style.width = of ? Math.min(100, 100 * value / of).toFixed(1) + "%" : "0";
    bar.appendChild(fill);
    row.appendChild(bar);
    row.appendChild(el("span", "", note || bytes(value) + (of ? " / " + bytes(of) : "")));
    box.appendChild(row);
  };
  line("weights", e.weight_bytes, 0, bytes(e.weight_bytes));
  line("KV held", e.kv_bytes_held, budget);
  line("running rows", e.kv_bytes_running, budget);
  line("prefix cache", e.prefix_cache_bytes, budget,
       bytes(e.prefix_cache_bytes) + ", hit rate " + (100 * e.prefix_cache_hit_rate).toFixed(0) + "%");
  line("pinned contexts", e.pinned_bytes, budget, e.pinned_sessions + " sessions, " + bytes(e.pinned_bytes));
  const disk = e.disk_tier;
  line("disk tier", disk ? disk.bytes_written : 0, disk ? disk.cap_bytes : 0,
       disk ? bytes(disk.bytes_written) + " written, " + disk.hit_tokens + " tokens read back" : "off");
}

// -- charts (uPlot) -------------------------------------------------------------------------------
const CHARTS = [["tokens_per_s", "tokens/s"], ["ttft_s", "TTFT (s)"], ["itl_s", "ITL (s)"],
                ["queue_depth", "queued"]];
const plots = {};

function renderCharts(history) {
  const xs = history.map((p) => -p.ago);
  for (const [key, label] of CHARTS) {
    const ys = history.map((p) => p[key]);
    if (!plots[key]) {
      const box = el("div", "chart");
      box.dataset.series = key;
      $("charts").appendChild(box);
      plots[key] = new uPlot({
        width: Math.max(200, ($("charts").clientWidth || 500) / 2 - 8), height: 120, title: label,
        legend: { show: false }, cursor: { show: false },
        scales: { x: { time: false } },
        axes: [{ values: (u, v) => v.map((s) => s.toFixed(0) + "s") }, { size: 50 }],
        series: [{}, { stroke: "#3b78d8", width: 1.5, spanGaps: true }],
      }, [xs, ys], box);
    } else {
      plots[key].setData([xs, ys]);
    }
  }
}

// -- the timeline: one lane per program (or request), its calls as bars ----------------------------
function renderTimeline(records) {
  const lanes = new Map();
  for (const r of records) {
    if (!lanes.has(r.lane)) lanes.set(r.lane, []);
    lanes.get(r.lane).push(r);
  }
  const recent = [...lanes.entries()]
    .map(([name, rs]) => [name, rs, Math.min(...rs.map((r) => r.finish_ago === null ? 0 : r.finish_ago))])
    .filter(([, , last]) => last < MAX_WINDOW_S)
    .sort((a, b) => a[2] - b[2] || (a[0] < b[0] ? -1 : 1)).slice(0, MAX_LANES);
  const oldest = Math.max(0, ...recent.flatMap(([, rs]) => rs.map((r) => r.arrival_ago)));
  const span = Math.min(MAX_WINDOW_S, Math.max(10, Math.ceil(oldest * 1.1)));
  $("window-s").textContent = span;
  const box = $("timeline");
  box.replaceChildren();
  const x = (ago) => Math.max(0, 100 * (1 - ago / span));
  for (const [name, rs] of recent) {
    const lane = el("div", "lane");
    lane.dataset.lane = name;
    const last = rs[rs.length - 1];
    if (last.aborted) lane.classList.add("aborted");
    lane.dataset.state = last.finish_ago === null ? "running" : last.aborted ? "aborted" : "finished";
    lane.appendChild(el("span", "lane-name", name));
    const track = el("div", "lane-track");
    for (const r of rs) {
      const end = r.finish_ago === null ? 0 : r.finish_ago;
      const admitted = r.admitted_ago === null ? end : r.admitted_ago;
      const first = r.first_token_ago === null ? end : r.first_token_ago;
      const seg = (cls, from, to, title) => {
        if (from < to || x(from) >= 100) return;
        const b = el("div", "bar " + cls);
        b.style.left = x(from) + "%";
        b.style.width = Math.max(0.3, x(to) - x(from)) + "%";
        b.title = title;
        b.dataset.request = r.id;
        track.appendChild(b);
      };
      const tip = `${r.id}: ${r.prompt_tokens} prompt tokens (${r.cached_tokens} cached), ` +
        `${r.output_tokens} generated` + (r.finish_reason ? `, ${r.finish_reason}` : "");
      seg("queued", r.arrival_ago, admitted, tip);
      // Cached tokens: the share of the prefill bar the cache served, hatched green.
      const share = r.prompt_tokens ? r.cached_tokens / r.prompt_tokens : 0;
      const cut = admitted - (admitted - first) * share;
      seg("cached", admitted, cut, tip + " (cached part)");
      seg("prefill", cut, first, tip);
      seg("decode", first, end, tip);
      for (const p of r.preempted_ago) {
        const m = el("div", "mark preempt");
        m.style.left = x(p) + "%";
        m.title = r.id + " preempted";
        track.appendChild(m);
      }
      if (r.aborted) {
        const m = el("div", "mark abort");
        m.style.left = "calc(" + x(end) + "% - 2px)";
        m.title = r.id + " aborted";
        track.appendChild(m);
      }
    }
    lane.appendChild(track);
    box.appendChild(lane);
  }
  if (!recent.length) box.appendChild(el("div", "", "no requests in the last minute"));
}

// -- the prefix tree --------------------------------------------------------------------------------
function renderTree(tree) {
  const box = $("tree");
  box.replaceChildren();
  if (!tree) { box.textContent = "no radix tree (prefix caching is off, or this model's layout keeps snapshots)"; return; }
  $("tree-summary").textContent = `${tree.total_nodes} nodes, ${tree.total_tokens} tokens, ` +
    `${bytes(tree.bytes)}, hit rate ${(100 * tree.hit_rate).toFixed(0)}%` +
    (tree.shown < tree.total_nodes ? ` (the ${tree.shown} most used shown)` : "");
  const kids = new Map();
  for (const n of tree.nodes) {
    const k = n.parent === null ? "root" : n.parent;
    if (!kids.has(k)) kids.set(k, []);
    kids.get(k).push(n);
  }
  const used = (n) => n.hits * 1000 + n.in_use * 10 + n.program_count;
  const draw = (parent, into) => {
    const all = (kids.get(parent) || []).sort((a, b) => used(b) - used(a));
    for (const n of all.slice(0, MAX_CHILDREN)) {
      const node = el("div", "tree-node");
      node.dataset.node = n.id;
      node.dataset.hits = n.hits;
      node.dataset.programs = n.program_count;
      const line = el("div", "tree-line");
      line.appendChild(el("span", "tree-text", n.text.replace(/\n/g, "\u23ce")));
      line.appendChild(el("span", "tree-meta", `${n.tokens} tokens at ${n.start_token}, ${bytes(n.bytes)}`));
      line.appendChild(el("span", "hits", `${n.hits} hits`));
      const progs = n.program_count ? `${n.program_count} programs: ${n.programs.join(", ")}` +
        (n.program_count > n.programs.length ? ", ..." : "") : "";
      line.appendChild(el("span", "tree-meta", progs + (n.in_use ? ` (in use by ${n.in_use})` : "")));
      node.appendChild(line);
      into.appendChild(node);
      draw(n.id, node);
    }
    if (all.length > MAX_CHILDREN) {
      const more = all.slice(MAX_CHILDREN);
      into.appendChild(el("div", "tree-node tree-meta", `... ${more.length} more branches, ` +
        `${more.reduce((t, n) => t + n.hits, 0)} hits`));
    }
  };
  draw("root", box);
}

// -- the stream -------------------------------------------------------------------------------------
function render(snap) {
  const e = snap.engine;
  $("model").textContent = e.model || "";
  $("summary").textContent = `${e.tokens_per_s.toFixed(1)} tok/s, ${e.rows_running} decoding, ` +
    `${e.rows_waiting} waiting, ${e.requests_finished} finished, ${e.preemptions} preemptions`;
  renderBatch(snap.requests);
  renderMemory(e);
  renderTimeline(snap.timeline);
  renderTree(snap.tree);
  renderCharts(snap.history);
  document.body.dataset.updated = String(snap.time);
}

let source = null;

function connect() {
  source = new EventSource("/v1/status/stream");
  source.addEventListener("open", () => { $("conn").textContent = "live"; $("conn").className = "conn"; });
  source.addEventListener("status", (ev) => render(JSON.parse(ev.data)));
  source.addEventListener("engine_dead", () => { $("conn").textContent = "engine stopped"; });
  source.addEventListener("error", () => {
    $("conn").textContent = "reconnecting";
    $("conn").className = "conn down";
    if (source.readyState === EventSource.CLOSED) {  // the browser gave up (e.g. an error status): retry ourselves
      source.close();
      setTimeout(connect, 1000);
    }
  });
}

connect();
