// monarch dashboard: one page per view, each backed by the JSON API (/openapi.json), live through one SSE stream.
"use strict";

const COLORS = [36, 33, 32, 35, 34, 31, 96, 93, 92, 95, 94, 91]; // the terminal's rank colours (jobs/output.py)
const PLOT = ["#1c7ed6", "#f08c00", "#2f9e44", "#ae3ec9", "#1098ad", "#e03131", "#5c940d", "#d6336c", "#4263eb", "#0ca678", "#f59f00", "#7048e8"];
const ROW = 18;
const KEEP_LINES = 200000; // lines a page holds while following; earlier ones are fetched again on scrolling up
const $main = document.getElementById("main");
let stream = null;   // the one EventSource
let page = null;     // {name, cleanup}
const TOKEN = new URLSearchParams(location.search).get("token") || ""; // sent with every request (no cookie)

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined) e.setAttribute(k, v);
  }
  for (const k of kids.flat()) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
  return e;
}
async function api(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: { "X-Monarch-Token": TOKEN } });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(body.detail || `${r.status} ${r.statusText}`);
  return body;
}
function listen(params, handlers) {
  if (stream) stream.close();
  const q = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== null && v !== undefined && v !== ""));
  q.set("token", TOKEN); // EventSource cannot send headers
  stream = new EventSource("api/events?" + q);
  const live = document.getElementById("live");
  stream.onopen = () => { live.className = "live on"; };
  stream.onerror = () => { live.className = "live off"; };
  for (const [kind, fn] of Object.entries(handlers)) stream.addEventListener(kind, (ev) => fn(JSON.parse(ev.data)));
}
const fmtTime = (t) => t ? new Date(t * 1000).toLocaleString() : "-";
const fmtDur = (s) => s === null || s === undefined ? "-" : s < 60 ? `${s.toFixed(1)} s` : s < 3600 ? `${Math.floor(s / 60)} m ${Math.round(s % 60)} s` : `${(s / 3600).toFixed(1)} h`;
const fmt = (v, d = 0, unit = "") => v === null || v === undefined ? "-" : `${Number(v).toFixed(d)}${unit}`;
function compress(ranks) {
  const out = []; const s = [...new Set(ranks)].sort((a, b) => a - b);
  for (let i = 0; i < s.length;) { let j = i; while (j + 1 < s.length && s[j + 1] === s[j] + 1) j++; out.push(i === j ? `${s[i]}` : `${s[i]}-${s[j]}`); i = j + 1; }
  return out.join(",");
}
function runBadge(r) {
  if (r.ended_at === null || r.ended_at === undefined) return el("span", { class: "badge run" }, "running");
  if (r.exit_code === null) return el("span", { class: "badge bad" }, "no result");  // its client died (event run_lost), or it failed to run
  if (r.interrupted) return el("span", { class: "badge warn" }, `interrupted (${r.exit_code})`);
  return r.exit_code === 0 ? el("span", { class: "badge ok" }, "ok") : el("span", { class: "badge bad" }, `exit ${r.exit_code}`);
}
function show(...kids) { $main.replaceChildren(...kids); }
function failed(e) { show(el("div", { class: "panel error" }, String(e.message || e))); }

// ------------------------------------------------------------------------------------------------ hosts
async function hostsPage() {
  const box = el("div");
  show(el("h1", {}, "Hosts"), box);
  async function draw() {
    const d = await api("api/hosts");
    document.getElementById("reservation").textContent = d.reservation_id ? `${d.scheduler} · ${d.reservation_id}` : "";
    const rows = d.hosts.map((h) => el("tr", {},
      el("td", {}, el("span", { class: "dot " + (h.alive ? "up" : "down") }), h.name),
      el("td", {}, h.alive === null || h.alive === undefined ? "-" : h.alive ? "alive" : "not answering"),
      el("td", {}, h.warm === null ? "-" : h.warming ? "warming" : h.warm ? "ready" : "cold"),
      el("td", { class: "num" }, h.ranks_running ?? "-"),
      el("td", { class: "num" }, h.cpus ?? "-"), el("td", { class: "num" }, h.gpus ?? "-"),
      el("td", { class: "num" }, fmt(h.cpu_percent, 0, " %")), el("td", { class: "num" }, fmt(h.rss_mb, 0, " MiB")),
      el("td", { class: "num" }, h.gpu_util === null ? "-" : `${fmt(h.gpu_util, 0, " %")} · ${fmt(h.gpu_mem_mb, 0, " MiB")}`),
      el("td", { class: "muted" }, h.agent || "")));
    box.replaceChildren(
      d.stale ? el("div", { class: "panel error" }, d.stale) : "",
      el("div", { class: "panel" }, el("table", {},
        el("tr", {}, ...["host", "agent", "warm process", "ranks now", "cpus", "gpus", "ranks' cpu", "ranks' rss", "gpu", "address"].map((h, i) => el("th", { class: i >= 3 && i <= 8 ? "num" : "" }, h))),
        ...rows)),
      el("p", { class: "muted" }, d.run_id ? `CPU, RSS and GPU: the newest sample of each rank of run ${d.run_id}, summed per host.` : "No run recorded yet."));
  }
  await draw();
  const timer = setInterval(() => { if (!document.hidden) draw().catch(() => {}); }, 5000);
  listen({}, { runs: () => draw().catch(() => {}) });
  return () => clearInterval(timer);
}

// ------------------------------------------------------------------------------------------------- runs
async function runsPage() {
  const box = el("div", { class: "panel wide" });
  show(el("h1", {}, "Runs"), box);
  function draw(runs) {
    if (!runs.length) { box.replaceChildren(el("span", { class: "muted" }, "No run recorded yet: start one with monarch run-spmd.")); return; }
    box.replaceChildren(el("table", { id: "runs" },
      el("tr", {}, ...["run", "status", "started", "duration", "ranks", "hosts", "failed", "restarts", "command", ""].map((h) => el("th", {}, h))),
      ...runs.map((r) => el("tr", { "data-run": r.run_id },
        el("td", {}, el("a", { href: `#/run/${r.run_id}` }, r.run_id)), el("td", {}, runBadge(r)),
        el("td", {}, fmtTime(r.started_at)),
        el("td", { class: "num" }, fmtDur(r.seconds ?? (r.ended_at ? null : Date.now() / 1000 - r.started_at))),
        el("td", { class: "num" }, r.world_size ?? "-"), el("td", { class: "num" }, r.hosts ?? "-"),
        el("td", { class: "num" }, r.failed || ""), el("td", { class: "num" }, r.restarts || ""),
        el("td", { class: "cmd", title: r.command }, el("span", {}, r.command)),
        el("td", {}, el("a", { href: `#/plots/${r.run_id}` }, "plots"))))));
  }
  let runs = await api("api/runs");
  draw(runs);
  listen({}, { runs: (d) => { runs = d.runs; draw(runs); } });
  // running rows' durations tick here, without asking the server
  const timer = setInterval(() => { if (!document.hidden && runs.some((r) => r.ended_at === null)) draw(runs); }, 1000);
  return () => clearInterval(timer);
}

// -------------------------------------------------------------------------------------------------- run
async function runPage(runId) {
  const d = await api(`api/runs/${encodeURIComponent(runId)}`);
  runId = d.run.run_id;
  const r = d.run;
  const width = String(Math.max(0, (r.world_size || 1) - 1)).length;
  const head = el("div", { class: "panel summary" });
  const exits = el("div", { class: "panel" });
  const rankBox = el("input", { type: "text", id: "rank-filter", placeholder: "ranks, e.g. 0,2-3" });
  const textBox = el("input", { type: "text", id: "search", placeholder: "search output" });
  const follow = el("input", { type: "checkbox", id: "follow", checked: "" });
  const count = el("span", { class: "muted", id: "line-count" });
  const log = el("div", { class: "log", id: "log" });
  const spacer = el("div", { class: "spacer" });
  log.append(spacer);
  show(el("h1", {}, `Run ${runId}`), head, exits,
    el("div", { class: "controls" }, "Ranks", rankBox, "Search", textBox, el("label", {}, follow, " follow"), count), log);

  function drawHead(run, ranks) {
    const bad = ranks.filter((x) => x.status);
    head.replaceChildren(
      el("div", {}, el("span", { class: "muted" }, "status"), el("b", {}, runBadge(run))),
      el("div", {}, el("span", { class: "muted" }, "started"), el("b", {}, fmtTime(run.started_at))),
      el("div", {}, el("span", { class: "muted" }, "duration"), el("b", {}, fmtDur(run.ended_at ? run.ended_at - run.started_at : Date.now() / 1000 - run.started_at))),
      el("div", {}, el("span", { class: "muted" }, "ranks"), el("b", {}, run.world_size ?? "-")),
      el("div", {}, el("span", { class: "muted" }, "failed"), el("b", {}, bad.length ? compress(bad.map((x) => x.rank)) : "none")),
      el("div", { style: "flex-basis:100%" }, el("span", { class: "muted" }, "command"), el("code", {}, " " + run.command)));
    const many = ranks.length > 16;
    const shown = many ? ranks.filter((x) => x.status || x.ended_at === null) : ranks;
    exits.replaceChildren(el("details", { open: "" }, el("summary", {}, el("b", {}, "Exit table"),
      many ? el("span", { class: "muted" }, ` (${ranks.length} ranks; ${ranks.length - shown.length} exited 0 not shown)`) : ""),
      el("table", { id: "exit-table" }, el("tr", {}, ...["rank", "host", "local", "pid", "how", "ended", "lines", "last output"].map((h) => el("th", {}, h))),
        ...shown.map((x) => el("tr", {}, el("td", {}, el("span", { class: "c" + COLORS[x.rank % COLORS.length] }, `rank${x.rank}`)),
          el("td", {}, x.host), el("td", { class: "num" }, x.local_rank), el("td", { class: "num" }, x.pid ?? "-"),
          el("td", {}, x.how ? el("span", { class: "badge " + (x.status ? "bad" : "ok") }, x.how) : el("span", { class: "badge run" }, "running")),
          el("td", {}, fmtTime(x.ended_at)), el("td", { class: "num" }, x.lines ?? 0), el("td", {}, fmtTime(x.last_output_at)))))));
  }
  drawHead(r, d.ranks);

  // A virtual list: only the rows in view are in the DOM, so 100k lines scroll like 100.
  let lines = [];
  let more = false;
  const needle = () => textBox.value.trim().toLowerCase();
  function rowFor(l, i) {
    const div = el("div", { class: "row" + (l.stream === "stderr" ? " err" : ""), style: `top:${i * ROW}px` });
    div.append(el("span", { class: "c" + COLORS[l.rank % COLORS.length] }, `[rank${l.rank}]`.padEnd(width + 7) + " "));
    const n = needle();
    const text = l.line;
    const at = n ? text.toLowerCase().indexOf(n) : -1;
    if (at >= 0) div.append(text.slice(0, at), el("mark", {}, text.slice(at, at + n.length)), text.slice(at + n.length));
    else div.append(text);
    return div;
  }
  function render() {
    spacer.style.height = `${lines.length * ROW}px`;
    const first = Math.max(0, Math.floor(log.scrollTop / ROW) - 20);
    const last = Math.min(lines.length, first + Math.ceil(log.clientHeight / ROW) + 40);
    const rows = [];
    for (let i = first; i < last; i++) rows.push(rowFor(lines[i], i));
    spacer.replaceChildren(...rows);
    count.textContent = `${lines.length.toLocaleString()} line(s) loaded${more ? " · scroll up for earlier" : ""}`;
  }
  let pending = false;
  function schedule() { if (!pending) { pending = true; requestAnimationFrame(() => { pending = false; render(); if (follow.checked) log.scrollTop = log.scrollHeight; }); } }
  log.addEventListener("scroll", async () => {
    render();
    if (log.scrollTop === 0 && more && lines.length) {
      const page = await api(query("logs", { before: lines[0].id, limit: 2000 }));
      more = page.more;
      lines = page.lines.concat(lines);
      log.scrollTop = page.lines.length * ROW;
      render();
    }
    follow.checked = log.scrollTop + log.clientHeight >= log.scrollHeight - ROW;
  });
  function query(what, extra) {
    const q = new URLSearchParams({ ...extra });
    if (rankBox.value.trim()) q.set("ranks", rankBox.value.trim());
    if (textBox.value.trim()) q.set("q", textBox.value.trim());
    return `api/runs/${encodeURIComponent(runId)}/${what}?${q}`;
  }
  async function reload() {
    const page = await api(query("logs", { limit: 2000 }));
    lines = page.lines; more = page.more;
    follow.checked = true;
    schedule();
    const last = lines.length ? lines[lines.length - 1].id : 0;
    listen({ run: runId, after: last, ranks: rankBox.value.trim(), q: textBox.value.trim() }, {
      logs: (p) => {
        lines = lines.concat(p.lines);
        if (lines.length > KEEP_LINES) { lines = lines.slice(lines.length - KEEP_LINES); more = true; } // older ones: scroll up
        schedule();
      },
      runs: async () => { const x = await api(`api/runs/${encodeURIComponent(runId)}`); drawHead(x.run, x.ranks); },
    });
  }
  let debounce = null;
  for (const box of [rankBox, textBox]) box.addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(() => reload().catch(failed), 250); });
  await reload();
}

// ------------------------------------------------------------------------------------------------ plots
async function plotsPage(runId) {
  const d = await api(`api/runs/${encodeURIComponent(runId)}`);
  runId = d.run.run_id;
  const rankBox = el("input", { type: "text", id: "plot-ranks", placeholder: "ranks, e.g. 0-7 (default: all)" });
  const grid = el("div", { class: "plots" });
  show(el("h1", {}, `Plots · run ${runId}`), el("div", { class: "controls" }, "Ranks", rankBox,
    el("span", { class: "muted" }, "per rank over time: step time, CPU, memory, GPU, and every key=value number the run prints")), grid);
  // metric -> rank -> [[t...], [v...]]
  const data = {};
  const charts = {};
  window.monarchCharts = charts; // for scripts and tests: metric -> {plot (uPlot), key, box}
  const order = ["step time (ms)", "CPU (%)", "RSS (MiB)", "GPU utilisation (%)", "GPU memory (MiB)"];
  const add = (metric, rank, t, v) => {
    if (v === null || v === undefined) return;
    const m = data[metric] || (data[metric] = {});
    const s = m[rank] || (m[rank] = [[], []]);
    s[0].push(t); s[1].push(v);
  };
  function ingest(delta) {
    for (const [rank, t, step, dt] of delta.steps) if (step > 1) add("step time (ms)", rank, t, dt); // step 1 counts start-up
    for (const [rank, t, cpu, rss, gu, gm] of delta.samples) {
      add("CPU (%)", rank, t, cpu); add("RSS (MiB)", rank, t, rss); add("GPU utilisation (%)", rank, t, gu); add("GPU memory (MiB)", rank, t, gm);
    }
    for (const [key, points] of Object.entries(delta.numbers)) for (const [rank, t, v] of points) add(key, rank, t, v);
    return delta.cursors;
  }
  function wanted() {
    const text = rankBox.value.trim();
    if (!text) return null;
    const out = new Set();
    for (const part of text.split(",")) { const [a, b] = part.split("-").map(Number); if (!isNaN(a)) for (let i = a; i <= (isNaN(b) ? a : b); i++) out.add(i); }
    return out;
  }
  function draw() {
    const only = wanted();
    const metrics = Object.keys(data).sort((a, b) => (order.indexOf(a) + 1 || 99) - (order.indexOf(b) + 1 || 99) || a.localeCompare(b));
    if (!metrics.length) { grid.replaceChildren(el("div", { class: "panel muted" }, "No samples, steps or key=value numbers recorded for this run yet.")); return; }
    if (grid.querySelector(".muted.panel")) grid.replaceChildren();
    for (const metric of metrics) {
      const ranks = Object.keys(data[metric]).map(Number).filter((r) => !only || only.has(r)).sort((a, b) => a - b);
      const tables = ranks.map((r) => data[metric][r]);
      const aligned = tables.length ? uPlot.join(tables) : [[]];
      const key = ranks.join(",");
      let c = charts[metric];
      if (c && c.key !== key) { c.plot.destroy(); c.box.remove(); c = null; }
      if (!c) {
        const box = el("div", { class: "panel plot", "data-metric": metric }, el("h2", {}, metric));
        grid.append(box);
        const opts = {
          width: Math.max(560, box.clientWidth - 32), height: 240,
          scales: { x: { time: true } },
          legend: { show: ranks.length <= 16 },
          series: [{}, ...ranks.map((r, i) => ({ label: `rank ${r}`, stroke: PLOT[i % PLOT.length], width: 1.5, spanGaps: true, points: { show: false } }))],
          axes: [{}, { size: 60 }],
        };
        c = charts[metric] = { plot: new uPlot(opts, aligned, box), key, box };
      } else c.plot.setData(aligned);
    }
  }
  // each answer holds a bounded number of points; `more` says ask again from its cursors
  let answer = await api(`api/runs/${encodeURIComponent(runId)}/series`);
  let cursors = ingest(answer);
  while (answer.more) {
    answer = await api(`api/runs/${encodeURIComponent(runId)}/series?` + new URLSearchParams(cursors));
    cursors = ingest(answer);
  }
  draw();
  let timer = null;
  rankBox.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(draw, 250); });
  let dirty = false;
  listen({ run: runId, series: "true", samples: cursors.samples, steps: cursors.steps, logs: cursors.logs }, {
    series: (delta) => { cursors = ingest(delta); if (!dirty) { dirty = true; setTimeout(() => { dirty = false; draw(); }, 1000); } },
  });
  const resize = () => { for (const c of Object.values(charts)) c.plot.setSize({ width: Math.max(560, c.box.clientWidth - 32), height: 240 }); };
  window.addEventListener("resize", resize);
  return () => window.removeEventListener("resize", resize);
}

// ----------------------------------------------------------------------------------------------- stacks
function drawGroups(groups) {
  return el("div", { class: "groups", id: "stack-groups" }, ...groups.map((g) => el("div", { class: "group" },
    el("details", groups.length <= 3 ? { open: "" } : {}, el("summary", {}, el("b", {}, `${g.ranks.length} rank${g.ranks.length === 1 ? "" : "s"} (${g.ranks_text || compress(g.ranks)})`), ": ", g.summary),
      el("pre", {}, (g.frames || []).map((f) => typeof f === "string" ? f : `${f.function} (${f.file}:${f.line})`).join("\n"))))));
}
async function stacksPage() {
  const box = el("div", { class: "panel" });
  const button = el("button", { id: "capture" }, "Capture now");
  const note = el("span", { class: "muted" });
  show(el("h1", {}, "Stacks"), el("div", { class: "controls" }, button, note), box);
  function draw(s) {
    if (!s.groups || !s.groups.length) { box.replaceChildren(el("span", { class: "muted" }, "No stack captured for the newest run yet.")); return; }
    note.textContent = `run ${s.run_id} · captured ${fmtTime(s.ts)}${s.seconds !== undefined ? ` in ${s.seconds} s` : ""} · ${(s.method || []).join(", ")}`;
    box.replaceChildren(el("p", {}, `${s.groups.reduce((n, g) => n + g.ranks.length, 0)} rank(s), ${s.groups.length} distinct stack(s), largest group first:`), drawGroups(s.groups));
  }
  async function capture() {
    button.disabled = true; note.textContent = "capturing…";
    try { const s = await api("api/stacks", { method: "POST" }); if (s.live === false) note.textContent = "no live rank to capture: showing the newest stored capture"; draw(s.live === false ? await api("api/runs/latest/stacks") : s); }
    catch (e) { note.textContent = e.message; } finally { button.disabled = false; }
  }
  button.addEventListener("click", capture);
  const stored = await api("api/runs/latest/stacks");
  draw(stored);
  const runs = await api("api/runs?limit=1");
  if (runs.length && runs[0].ended_at === null) await capture();
}

// --------------------------------------------------------------------------------------------- diagnose
async function diagnosePage() {
  const box = el("div");
  const button = el("button", { id: "rediagnose" }, "Diagnose again");
  show(el("h1", {}, "Diagnose"), el("div", { class: "controls" }, button), box);
  async function draw() {
    box.replaceChildren(el("div", { class: "panel muted" }, "asking the ranks…"));
    const d = await api("api/diagnose");
    const label = { healthy: "healthy", suspect: "suspect found", unknown: "cannot tell" }[d.verdict];
    const ev = d.evidence || {};
    box.replaceChildren(
      el("div", { class: "panel" }, el("div", { class: "verdict " + d.verdict, id: "verdict" }, label), el("p", {}, d.summary),
        d.run_id ? el("a", { href: `#/run/${d.run_id}` }, `run ${d.run_id}`) : ""),
      d.suspects.length ? el("div", { class: "panel" }, el("h2", {}, "Suspects"), el("table", {},
        el("tr", {}, el("th", {}, "rank"), el("th", {}, "host"), el("th", {}, "why")),
        ...d.suspects.map((s) => el("tr", {}, el("td", {}, s.rank), el("td", {}, s.host || "-"), el("td", { style: "white-space:normal" }, s.reasons.join("; ")))))) : "",
      ev.stack_groups && ev.stack_groups.length ? el("div", { class: "panel" }, el("h2", {}, "Stacks"), drawGroups(ev.stack_groups)) : "",
      ev.last_lines && ev.last_lines.length ? el("div", { class: "panel" }, el("h2", {}, "Last lines of the failed rank"), el("pre", {}, ev.last_lines.join("\n"))) : "");
  }
  button.addEventListener("click", () => draw().catch(failed));
  await draw();
}

// ---------------------------------------------------------------------------------------------- routing
const PAGES = { hosts: hostsPage, runs: runsPage, run: runPage, plots: plotsPage, stacks: stacksPage, diagnose: diagnosePage };
async function route() {
  const [name, arg] = (location.hash.replace(/^#\/?/, "") || "runs").split("/");
  const go = PAGES[name] ? name : "runs";
  if (page && page.cleanup) page.cleanup();
  if (stream) { stream.close(); stream = null; }
  document.getElementById("live").className = "live none";
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("on", a.dataset.page === go);
  page = { name: go };
  $main.dataset.page = go;
  $main.dataset.ready = "";
  try { page.cleanup = await PAGES[go](decodeURIComponent(arg || "latest")); }
  catch (e) { failed(e); }
  $main.dataset.ready = "1";
}
window.addEventListener("hashchange", route);
if (!location.hash) history.replaceState(null, "", location.pathname + location.search + "#/runs");
route();
api("api/hosts").then((d) => { if (d.reservation_id) document.getElementById("reservation").textContent = `${d.scheduler} · ${d.reservation_id}`; }).catch(() => {});
