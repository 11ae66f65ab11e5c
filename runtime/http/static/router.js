// The router's dashboard: one panel per worker (GET /dashboard/stream on the router).
"use strict";

const panels = new Map(); // worker URL -> {root, fields, charts}

function panelFor(url) {
  let p = panels.get(url);
  if (p) return p;
  const root = document.createElement("div");
  root.className = "panel worker";
  root.dataset.url = url;
  const head = document.createElement("h2");
  const link = document.createElement("a");
  link.href = url + "/dashboard"; link.textContent = url; link.target = "_blank";
  head.appendChild(link);
  const health = document.createElement("span");
  health.className = "health";
  head.append(" ", health);
  const table = document.createElement("table");
  const fields = { health };
  for (const [key, label] of [["load", "in flight (routed by us)"], ["routed", "requests routed"],
    ["predicted", "predicted hit rate"], ["reported", "reported hit rate"], ["reqs", "running / waiting"],
    ["kv", "KV in use"], ["decode", "decode tokens/s"]]) {
    const row = table.insertRow();
    row.insertCell().textContent = label;
    const cell = row.insertCell();
    cell.className = "field-" + key;
    fields[key] = cell;
  }
  const hitChart = document.createElement("div"), loadChart = document.createElement("div");
  root.append(head, table, hitChart, loadChart);
  el("workers").appendChild(root);
  p = { root, fields, charts: {
    hit: new RollingChart(hitChart, [{ label: "predicted" }, { label: "reported" }],
      { y: { range: [0, 1] }, yFormat: pct, height: 140 }),
    load: new RollingChart(loadChart, [{ label: "in flight" }, { label: "running" }, { label: "waiting" }],
      { height: 140 }),
  } };
  panels.set(url, p);
  return p;
}

function update(sample) {
  el("policy").textContent = `policy ${sample.policy} · ${sample.queued} queued`;
  const seen = new Set();
  for (const w of sample.workers) {
    seen.add(w.url);
    const p = panelFor(w.url), f = p.fields, s = w.stats;
    f.health.textContent = w.healthy ? "healthy" : "unhealthy";
    f.health.className = "health " + (w.healthy ? "good" : "bad");
    f.load.textContent = w.load;
    f.routed.textContent = w.routed;
    f.predicted.textContent = pct(w.estimated_hit_rate);
    f.reported.textContent = pct(w.actual_hit_rate);
    f.reqs.textContent = s ? `${s.num_running_reqs} / ${s.num_waiting_reqs}` : "–";
    f.kv.textContent = s ? pct(1 - s.kv.free / s.kv.capacity) : "–";
    f.decode.textContent = s ? fmt(s.rates.decode_tokens_per_s) : "–";
    p.charts.hit.push(sample.time, [w.estimated_hit_rate, w.actual_hit_rate]);
    p.charts.load.push(sample.time, [w.load, s ? s.num_running_reqs : null, s ? s.num_waiting_reqs : null]);
  }
  for (const [url, p] of panels) {
    if (!seen.has(url)) { p.root.remove(); panels.delete(url); } // the worker was removed
  }
}

openStream("/dashboard/stream", { stats: update }, el("conn"));
