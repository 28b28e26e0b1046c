// The cached dashboard: polls the daemon's /status and /history (relative URLs, so it
// works behind a proxy or a port-forward) every 2 s and renders them. Vanilla JS, charts
// drawn as inline SVG: no library, no external asset.
//
// Job names come from clients: they are only ever set with textContent or as attribute
// values, never parsed as HTML.
"use strict";

(() => {
  const POLL_MS = 2000;
  // The verdict's rule (docs/observability.md): a job is input-bound when its loop waited
  // more than WAIT_LIMIT of its time over the last WINDOW_S. The store is the cause when it
  // is unreachable, or when most of that wait fell in sampling intervals in which a reader
  // waited for a shard from the store (a demand miss); else the node is (decoding in the
  // DataLoader workers, CPU, transport).
  const WAIT_LIMIT = 0.2;
  const WINDOW_S = 60;
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
    "#8c564b", "#e377c2"];
  const FETCH_COLOR = "#1f77b4";
  const SERVE_COLOR = "#2ca02c";
  const SVG = "http://www.w3.org/2000/svg";

  // What the page last rendered, for people and tests: the raw /status and /history.
  const state = { renders: 0, status: null, history: null, verdict: null, lastOk: null };
  window.cachedDashboard = state;

  // -- formatting (the same units as `cached status`) -------------------------------------

  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    for (const unit of units) {
      if (Math.abs(n) < 1024 || unit === "TiB") {
        return unit === "B" ? `${n.toFixed(0)} B` : `${n.toFixed(1)} ${unit}`;
      }
      n /= 1024;
    }
    return "";
  }
  // An axis label: as few digits as tell the gridlines apart ("500 KiB/s", "2.5 MiB/s").
  function fmtBytesShort(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return `${n.toFixed(n > 0 && n < 10 && !Number.isInteger(n) ? 1 : 0)} ${units[i]}`;
  }
  const fmtInt = (n) => String(Math.round(n)).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  const fmtPct = (f) => `${(100 * f).toFixed(1)}%`;
  function fmtSecs(s) {
    if (s < 120) return `${s.toFixed(1)} s`;
    if (s < 7200) return `${(s / 60).toFixed(1)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }

  // -- small DOM helpers ----------------------------------------------------------------

  const $ = (id) => document.getElementById(id);

  // A number on the page: its raw value (data-value, "" for none) and its rendering.
  function show(id, raw, text) {
    const el = $(id);
    el.dataset.value = raw === null || raw === undefined ? "" : String(raw);
    el.textContent = text;
  }

  function svg(tag, attrs, parent) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    if (parent) parent.appendChild(el);
    return el;
  }

  async function getJSON(path) {
    const response = await fetch(path, { cache: "no-store" });
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  // -- derived figures ------------------------------------------------------------------

  // The oldest sample within WINDOW_S of the newest: the base of "the last minute".
  function windowBase(samples) {
    if (!samples.length) return null;
    const newest = samples[samples.length - 1].t;
    return samples.find((s) => s.t >= newest - WINDOW_S) || null;
  }

  // A job's wait / loop since the base sample (since its start when the base predates it);
  // null when its loop did not run in the window.
  function recentWait(job, base) {
    const before = (base && base.jobs[job.job]) || { wait_s: 0, loop_s: 0 };
    let wait = job.wait_s - before.wait_s;
    let loop = job.loop_s - before.loop_s;
    if (wait < 0 || loop < 0) {
      // The job was dropped and came back: its counters started again.
      wait = job.wait_s;
      loop = job.loop_s;
    }
    return loop > 0 ? Math.min(1, Math.max(0, wait / loop)) : null;
  }

  function rate(samples, key) {
    const n = samples.length;
    if (n < 2) return null;
    const a = samples[n - 2], b = samples[n - 1];
    return b.t > a.t ? Math.max(0, (b[key] - a[key]) / (b.t - a.t)) : null;
  }

  // A job's wait over the window, split by the intervals it fell in: those in which readers
  // waited for shards from the store (demand misses rose) count against the store, the
  // others against the node. The intervals run from the base sample through every newer
  // one to /status now (from nothing when there is no sample yet).
  function waitByCause(name, status, samples, base) {
    const points = base ? samples.slice(samples.indexOf(base)) : [{ demand_misses: 0, jobs: {} }];
    const now = {
      demand_misses: status.counters.demand_misses,
      jobs: Object.fromEntries((status.jobs || []).map((j) => [j.job, j])),
    };
    points.push(now);
    let store = 0, node = 0;
    for (let i = 1; i < points.length; i++) {
      const a = points[i - 1], b = points[i];
      const after = b.jobs[name];
      if (!after) continue;
      const before = a.jobs[name] || { wait_s: 0 };
      let wait = after.wait_s - before.wait_s;
      if (wait < 0) wait = after.wait_s; // dropped and back: counting again from zero
      if (b.demand_misses > a.demand_misses) store += wait;
      else node += wait;
    }
    return { store, node };
  }

  function verdictOf(status, samples) {
    const base = windowBase(samples);
    const jobs = (status.jobs || []).map((job) => ({ job, recent: recentWait(job, base) }));
    const store = status.store || { reachable: true };
    const demand = status.counters.demand_misses - (base ? base.demand_misses : 0);
    const bound = jobs.filter((j) => j.recent !== null && j.recent > WAIT_LIMIT)
      .sort((a, b) => b.recent - a.recent);
    const v = { state: "", cause: "", job: "", text: "", why: "", recent: jobs };
    if (!jobs.length) {
      v.state = "no-jobs";
      v.text = "No job reports to this daemon";
      v.why = "Wrap the training loop's loader in a DeviceLoader or StallMeter (or use " +
        "FastLoader) and each job's wait for data shows here.";
      return v;
    }
    if (!bound.length) {
      const worst = jobs.filter((j) => j.recent !== null).sort((a, b) => b.recent - a.recent)[0];
      v.state = "ok";
      v.text = "No job is input-bound";
      v.why = worst
        ? `The job waiting most, ${worst.job.job}, waited ${fmtPct(worst.recent)} of its ` +
          "loop in the last minute."
        : "No job's loop ran in the last minute.";
      return v;
    }
    const top = bound[0];
    v.state = "input-bound";
    v.job = top.job.job;
    const more = bound.length > 1 ? ` (and ${bound.length - 1} more)` : "";
    const split = waitByCause(top.job.job, status, samples, base);
    v.split = split;
    const total = split.store + split.node;
    const share = (part) => (total > 0 ? fmtPct(part / total) : "all");
    if (!store.reachable || split.store > split.node) {
      v.cause = "store";
      v.text = `Input-bound: ${top.job.job}${more} waits ${fmtPct(top.recent)} of its loop ` +
        "— the store is the cause";
      v.why = !store.reachable
        ? "The object store is unreachable: shards the hot tier lacks cannot be fetched."
        : `${share(split.store)} of that wait came while readers waited for shards from ` +
          `the store (${fmtInt(demand)} demand miss${demand === 1 ? "" : "es"} in the last ` +
          "minute): fetching does not keep ahead of them.";
    } else {
      v.cause = "node";
      v.text = `Input-bound: ${top.job.job}${more} waits ${fmtPct(top.recent)} of its loop ` +
        "— this node is the cause";
      v.why = `${share(split.node)} of that wait came while the hot tier had every shard ` +
        "readers asked for: the wait is in decoding (DataLoader workers, CPU) or the " +
        "transport.";
    }
    return v;
  }

  // -- charts ---------------------------------------------------------------------------

  // series: [{name, color, points: [[t, value or null], ...]}]; a null breaks the line.
  function chart(el, series, opts) {
    const width = Math.max(200, Math.round(el.getBoundingClientRect().width) || 600);
    const height = 230;
    const m = { left: 70, right: 10, top: 10, bottom: 22 };
    const w = width - m.left - m.right, h = height - m.top - m.bottom;
    el.replaceChildren();
    el.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const { t0, t1, yMax, yFmt } = opts;
    const x = (t) => m.left + ((t - t0) / (t1 - t0)) * w;
    const y = (v) => m.top + h - (Math.min(v, yMax) / yMax) * h;
    const axis = svg("g", { class: "axis" }, el);
    for (const f of [0, 0.5, 1]) {
      svg("line", { x1: m.left, x2: m.left + w, y1: y(f * yMax), y2: y(f * yMax) }, axis);
      const label = svg("text", { x: m.left - 6, y: y(f * yMax) + 4, "text-anchor": "end" }, axis);
      label.textContent = yFmt(f * yMax);
    }
    const span = t1 - t0;
    const step = [10, 30, 60, 120, 300, 600].find((s) => span / s <= 5) || 600;
    for (let ago = 0; ago <= span + 0.001; ago += step) {
      const label = svg("text", { x: x(t1 - ago), y: height - 6, "text-anchor": "middle" }, axis);
      label.textContent = ago === 0 ? "now" : ago < 60 ? `−${ago} s` : `−${ago / 60} min`;
    }
    if (opts.threshold !== undefined) {
      svg("line", {
        class: "threshold", x1: m.left, x2: m.left + w,
        y1: y(opts.threshold), y2: y(opts.threshold),
      }, el);
    }
    for (const s of series) {
      const g = svg("g", { "data-series": s.name, "data-points": 0 }, el);
      let d = "", run = 0, shown = 0;
      const lone = [];
      s.points.forEach(([t, v], i) => {
        if (v === null || t < t0) {
          if (run === 1) lone.push(s.points[i - 1]);
          run = 0;
          return;
        }
        d += `${run ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
        run += 1;
        shown += 1;
      });
      if (run === 1) lone.push(s.points[s.points.length - 1]);
      g.setAttribute("data-points", String(shown));
      if (d) svg("path", { d, stroke: s.color, fill: "none", "stroke-width": 2 }, g);
      // A single point between gaps draws no line: mark it.
      for (const [t, v] of lone) svg("circle", { cx: x(t), cy: y(v), r: 3, fill: s.color }, g);
    }
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    return [1, 2, 5, 10].map((k) => k * p).find((n) => n >= v);
  }

  // Every job seen in the samples, and those /status has now, in one order: their colours.
  function jobNames(status, samples) {
    const names = new Set((status.jobs || []).map((job) => job.job));
    for (const s of samples) for (const name of Object.keys(s.jobs)) names.add(name);
    return [...names].sort();
  }

  function colorOf(name, names) {
    return PALETTE[names.indexOf(name) % PALETTE.length];
  }

  // A round top for a bytes/s axis, in the unit its labels use (1, 2 or 5 KiB/MiB/GiB).
  function niceBytes(v) {
    let unit = 1;
    while (v / unit >= 1024 && unit < 1024 ** 4) unit *= 1024;
    return niceMax(v / unit) * unit;
  }

  function drawCharts(history, names) {
    const samples = history.samples;
    const keep = history.keep_s || 600;
    const t1 = samples.length ? samples[samples.length - 1].t : Date.now() / 1000;
    // At most keep_s, at least a minute: a young daemon's chart is not stretched.
    const first = samples.length ? samples[0].t : t1;
    const t0 = Math.min(t1 - WINDOW_S, Math.max(first, t1 - keep));
    const deltas = (key) => samples.slice(1).map((b, i) => {
      const a = samples[i];
      return [b.t, b.t > a.t ? Math.max(0, (b[key] - a[key]) / (b.t - a.t)) : null];
    });
    const fetch = deltas("fetched_bytes"), serve = deltas("served_bytes");
    const top = Math.max(0, ...fetch.concat(serve).map(([, v]) => v || 0));
    chart($("chart-throughput"), [
      { name: "fetch", color: FETCH_COLOR, points: fetch },
      { name: "serve", color: SERVE_COLOR, points: serve },
    ], { t0, t1, yMax: niceBytes(top), yFmt: (v) => `${fmtBytesShort(v)}/s` });

    const series = names.map((name) => ({
      name,
      color: colorOf(name, names),
      points: samples.slice(1).map((b, i) => {
        const now = b.jobs[name];
        if (!now) return [b.t, null];
        const before = samples[i].jobs[name] || { wait_s: 0, loop_s: 0 };
        const loop = now.loop_s - before.loop_s;
        return [b.t, loop > 0 ? Math.min(1, Math.max(0, (now.wait_s - before.wait_s) / loop)) : null];
      }),
    }));
    chart($("chart-jobs"), series, { t0, t1, yMax: 1, yFmt: (v) => `${Math.round(100 * v)}%`, threshold: WAIT_LIMIT });
    const legend = $("jobs-legend");
    legend.replaceChildren();
    for (const s of series) {
      const key = document.createElement("span");
      key.className = "key";
      key.style.background = s.color;
      legend.appendChild(key);
      legend.appendChild(document.createTextNode(s.name + " "));
    }
  }

  // -- rendering ------------------------------------------------------------------------

  function render(status, history) {
    const samples = history.samples;
    const hot = status.hot, c = status.counters;
    show("version", status.version, status.version);
    show("uptime", status.uptime_s, fmtSecs(status.uptime_s));
    show("streams", status.streams, fmtInt(status.streams));

    const fill = hot.capacity_bytes > 0 ? hot.used_bytes / hot.capacity_bytes : 0;
    show("hot-fill", fill, fmtPct(fill));
    $("hot-bar").style.width = `${Math.min(100, 100 * fill).toFixed(2)}%`;
    show("hot-used", hot.used_bytes, fmtBytes(hot.used_bytes));
    show("hot-capacity", hot.capacity_bytes, fmtBytes(hot.capacity_bytes));
    show("hot-shards", hot.shards, fmtInt(hot.shards));
    show("hot-pinned", hot.pinned_shards, fmtInt(hot.pinned_shards));
    show("hot-fetching", hot.fetching_shards, fmtInt(hot.fetching_shards));

    const opens = c.hits + c.misses;
    show("hit-rate", opens > 0 ? c.hits / opens : null, opens > 0 ? fmtPct(c.hits / opens) : "–");
    show("hits", c.hits, fmtInt(c.hits));
    show("misses", c.misses, fmtInt(c.misses));
    show("demand-misses", c.demand_misses, fmtInt(c.demand_misses));

    const fr = rate(samples, "fetched_bytes"), sr = rate(samples, "served_bytes");
    show("fetch-rate", fr, fr === null ? "–" : `${fmtBytes(fr)}/s`);
    show("serve-rate", sr, sr === null ? "–" : `${fmtBytes(sr)}/s`);
    show("fetched-bytes", c.fetched_bytes, fmtBytes(c.fetched_bytes));
    show("served-bytes", c.served_bytes, fmtBytes(c.served_bytes));
    show("served-samples", c.served_samples, fmtInt(c.served_samples));

    const lead = status.prefetch.lead_s;
    show("lead", lead, lead === null ? "all resident" : fmtSecs(lead));
    $("lead").parentElement.classList.toggle("warn", lead !== null && lead < 5);

    const store = status.store || { reachable: true, since: null, last_error: null };
    show("store", store.reachable ? "reachable" : "unreachable",
      store.reachable ? "reachable" : "unreachable");
    $("store").parentElement.classList.toggle("bad", !store.reachable);
    const since = store.since ? new Date(store.since * 1000).toLocaleTimeString() : "";
    $("store-detail").textContent = store.reachable
      ? (since ? `answering since ${since}` : "")
      : `since ${since}: ${store.last_error || "no answer"}`;

    const v = verdictOf(status, samples);
    state.verdict = v;
    const box = $("verdict");
    box.dataset.state = v.state;
    box.dataset.cause = v.cause;
    box.dataset.job = v.job;
    $("verdict-text").textContent = v.text;
    $("verdict-why").textContent = v.why;

    const names = jobNames(status, samples);
    renderJobs(v.recent, names);
    drawCharts(history, names);
  }

  // recent: [{job: a /status job, recent: its wait fraction in the last minute or null}]
  function renderJobs(recent, names) {
    const body = $("jobs");
    body.replaceChildren();
    $("jobs-empty").hidden = recent.length > 0;
    for (const { job, recent: r } of recent) {
      const tr = document.createElement("tr");
      tr.dataset.job = job.job;
      tr.classList.toggle("bound", r !== null && r > WAIT_LIMIT);
      const cell = (field, raw, text) => {
        const td = document.createElement("td");
        td.dataset.field = field;
        td.dataset.value = raw === null || raw === undefined ? "" : String(raw);
        td.textContent = text;
        tr.appendChild(td);
        return td;
      };
      const name = cell("job", job.job, "");
      const key = document.createElement("span");
      key.className = "key";
      key.style.background = colorOf(job.job, names);
      name.appendChild(key);
      name.appendChild(document.createTextNode(job.job));
      cell("recent_wait_fraction", r, r === null ? "idle" : fmtPct(r));
      cell("wait_fraction", job.wait_fraction,
        job.wait_fraction === null ? "–" : fmtPct(job.wait_fraction));
      cell("batches", job.batches, fmtInt(job.batches));
      cell("ready", job.ready, job.ready === null ? "–" : fmtInt(job.ready));
      cell("reporters", job.reporters, fmtInt(job.reporters));
      cell("plans", job.plans, fmtInt(job.plans));
      cell("idle_s", job.idle_s, fmtSecs(job.idle_s));
      body.appendChild(tr);
    }
  }

  async function tick() {
    try {
      const [status, history] = await Promise.all([getJSON("status"), getJSON("history")]);
      state.status = status;
      state.history = history;
      render(status, history);
      state.lastOk = new Date();
      state.renders += 1;
      document.body.classList.remove("stale");
      $("freshness").textContent = `updated ${state.lastOk.toLocaleTimeString()}`;
    } catch (err) {
      // The daemon restarting or a port-forward dropping: say so on the page, keep
      // polling, and keep the last figures visible (greyed).
      document.body.classList.add("stale");
      $("freshness").textContent = state.lastOk
        ? `no answer since ${state.lastOk.toLocaleTimeString()} (${err.message})`
        : `no answer (${err.message})`;
    } finally {
      setTimeout(tick, POLL_MS);
    }
  }

  tick();
})();
