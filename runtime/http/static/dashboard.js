// The server's dashboard: the radix tree as an icicle (GET /cache/tree) and live charts (GET /dashboard/stream).
"use strict";

const TREE_PERIOD_MS = 2000; // the tree is polled less often than the stats: it is the costlier query
const ROW_HEIGHT = 44;
const HISTORY_SECONDS = 300; // of the samples the server already took, the charts start with the last five minutes
const SVG_NS = "http://www.w3.org/2000/svg";

// ---------------------------------------------------------------- stats
const charts = {
  kv: new RollingChart(el("chart-kv"), [
    { label: "free", stroke: "#2ca02c" }, { label: "evictable", stroke: "#1f77b4" },
    { label: "protected", stroke: "#d62728" }, { label: "held by running", stroke: "#ff7f0e" }]),
  hit: new RollingChart(el("chart-hit"), [{ label: "last second" }, { label: "since start" }],
    { y: { range: [0, 1] }, yFormat: pct }),
  tps: new RollingChart(el("chart-tps"), [
    { label: "prompt" }, { label: "cached" }, { label: "computed" }, { label: "decode" }]),
  reqs: new RollingChart(el("chart-reqs"), [{ label: "running" }, { label: "waiting" }]),
};

function addSample(s, redraw) {
  const kv = s.kv, r = s.rates;
  charts.kv.push(s.time, [kv.free, kv.evictable, kv.protected, kv.private], redraw);
  charts.hit.push(s.time, [r.hit_rate, s.cache.hit_rate], redraw);
  charts.tps.push(s.time, [r.prompt_tokens_per_s, r.cached_tokens_per_s, r.computed_tokens_per_s,
    r.decode_tokens_per_s], redraw);
  charts.reqs.push(s.time, [s.num_running_reqs, s.num_waiting_reqs], redraw);
}

function showTiles(s) {
  const c = s.cache, kv = s.kv;
  const hit = el("hit-rate");
  hit.textContent = pct(c.hit_rate);
  hit.dataset.hitRate = String(c.hit_rate);
  el("hit-detail").textContent = `${fmt(c.hit_tokens)} of ${fmt(c.hit_tokens + c.miss_tokens)} prompt tokens`;
  el("reqs").textContent = `${s.num_running_reqs} / ${s.num_waiting_reqs}`;
  el("decode").textContent = fmt(s.rates.decode_tokens_per_s);
  el("kv-used").textContent = pct(1 - kv.free / kv.capacity);
  el("kv-detail").textContent = `${fmt(kv.evictable)} evictable · ${fmt(kv.protected)} protected · ` +
    `${fmt(kv.private)} running · ${fmt(kv.capacity)} total`;
  for (const key of ["ttft", "itl"]) {
    const l = s.latency[key];
    el(key).textContent = l.count ? `${ms(l.p50)} / ${ms(l.p90)} / ${ms(l.p99)}` : "no streamed requests";
  }
}

openStream("/dashboard/stream", {
  history: samples => {
    if (!samples.length) return;
    const recent = samples.filter(s => s.time >= samples[samples.length - 1].time - HISTORY_SECONDS);
    recent.forEach(s => addSample(s, false)); Object.values(charts).forEach(c => c.redraw()); },
  stats: s => { addSample(s, true); showTiles(s); },
  error: e => { el("conn").textContent = "server error: " + e.message; },
}, el("conn"));
fetch("/dashboard/stats").then(r => r.json()).then(s => { el("model").textContent = s.model; });

// ---------------------------------------------------------------- tree
let lastTree = null;

function colourOf(node, tree, maxHits, maxAge) {
  const d = node.data;
  if (d.aggregated) return "#ccc";
  if (d.id === 0 || d.label) return "#e8e8e8";
  let t;
  if (el("colour").value === "hits") t = Math.log1p(d.hits) / Math.log1p(Math.max(1, maxHits));
  else t = 1 - Math.log1p(tree.clock - d.last_access) / Math.log1p(Math.max(1, maxAge));
  return `hsl(${220 - 200 * t}, ${65 + 20 * t}%, ${72 - 14 * t}%)`;
}

function describe(d, clock) {
  if (d.id === 0) return `the whole cache: ${d.subtree_tokens} tokens`;
  const lines = [d.aggregated ? `${d.label} (folded: too small or too many to draw)` : d.label || `node ${d.id}`,
    `tokens: ${d.tokens}` + (d.subtree_tokens !== d.tokens ? ` (subtree ${d.subtree_tokens})` : ""),
    `hits: ${d.hits}`, `last access: ${clock - d.last_access} cache operations ago`,
    `locks: ${d.lock_count}${d.lock_count ? " (in use, not evictable)" : ""}`, `tier: ${d.tier}`];
  return lines.join("\n");
}

function drawTree(tree) {
  lastTree = tree;
  const svg = el("tree");
  const width = svg.clientWidth || 1000;
  const root = d3.stratify().id(d => String(d.id)).parentId(d => (d.parent === null ? null : String(d.parent)))(tree.nodes)
    .sum(d => d.tokens).sort((a, b) => b.value - a.value);
  const height = (root.height + 1) * ROW_HEIGHT;
  d3.partition().size([width, height]).padding(1)(root);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const nodes = root.descendants();
  const real = nodes.filter(n => n.data.id > 0);
  const maxHits = Math.max(1, ...real.map(n => n.data.hits));
  const maxAge = Math.max(1, ...real.map(n => tree.clock - n.data.last_access));
  const frag = document.createDocumentFragment();
  for (const n of nodes) {
    const d = n.data, w = n.x1 - n.x0;
    if (w < 0.5) continue;
    const g = document.createElementNS(SVG_NS, "g");
    g.setAttribute("class", "node" + (d.lock_count > 0 ? " locked" : "") + (d.aggregated ? " aggregate" : ""));
    Object.assign(g.dataset, { id: d.id, tokens: d.tokens, subtreeTokens: d.subtree_tokens, hits: d.hits,
      locks: d.lock_count, tier: d.tier });
    const rect = document.createElementNS(SVG_NS, "rect");
    rect.setAttribute("x", n.x0); rect.setAttribute("y", n.y0);
    rect.setAttribute("width", w); rect.setAttribute("height", n.y1 - n.y0);
    rect.setAttribute("fill", colourOf(n, tree, maxHits, maxAge));
    g.appendChild(rect);
    if (w > 36) {
      const text = document.createElementNS(SVG_NS, "text");
      text.setAttribute("x", n.x0 + 4); text.setAttribute("y", n.y0 + 15);
      const head = d.id === 0 ? `cache · ${d.subtree_tokens} tokens` : `${d.tokens} tok${d.lock_count ? " · in use" : ""}`;
      const room = Math.floor((w - 8) / 6.2);
      text.textContent = head.slice(0, room);
      g.appendChild(text);
      if (d.id !== 0 && room > head.length + 3) {
        const sub = document.createElementNS(SVG_NS, "text");
        sub.setAttribute("x", n.x0 + 4); sub.setAttribute("y", n.y0 + 30);
        sub.textContent = d.text.replace(/\s+/g, " ").slice(0, room);
        g.appendChild(sub);
      }
    }
    g.addEventListener("mousemove", ev => showTip(ev, d));
    g.addEventListener("mouseleave", () => { el("tip").hidden = true; });
    frag.appendChild(g);
  }
  svg.replaceChildren(frag);
  el("tree-summary").textContent = `${tree.total_nodes} nodes, ${tree.total_tokens} tokens` +
    (tree.enabled ? "" : " (radix cache disabled)") + (real.length < tree.total_nodes ? `, ${real.length} drawn` : "");
}

function showTip(ev, d) {
  const tip = el("tip"), panel = tip.parentElement.getBoundingClientRect();
  tip.replaceChildren(document.createTextNode(describe(d, lastTree.clock)));
  if (d.text && d.id !== 0 && !d.aggregated) {
    const pre = document.createElement("span");
    pre.className = "preview";
    pre.textContent = d.text;
    tip.appendChild(pre);
  }
  tip.hidden = false;
  tip.style.left = Math.min(ev.clientX - panel.left + 12, panel.width - 470) + "px";
  tip.style.top = (ev.clientY - panel.top + 14) + "px";
}

async function pollTree() {
  try {
    const r = await fetch(`/cache/tree?max_nodes=${el("max-nodes").value}`);
    if (r.ok) drawTree(await r.json());
  } catch (e) { /* the stream shows the connection state */ }
  setTimeout(pollTree, TREE_PERIOD_MS);
}
el("colour").addEventListener("change", () => lastTree && drawTree(lastTree));
el("max-nodes").addEventListener("change", () => fetch(`/cache/tree?max_nodes=${el("max-nodes").value}`)
  .then(r => r.json()).then(drawTree));
pollTree();
