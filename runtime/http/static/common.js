// Helpers shared by the server's and the router's dashboards: number formats and rolling uPlot charts.
"use strict";

const WINDOW_POINTS = 600; // samples a chart keeps (10 minutes at one a second)
const GAP_SECONDS = 5;
const COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (Number.isInteger(x) || Math.abs(x) >= 10000) return Math.round(x).toLocaleString("en-US");
  return x.toFixed(digits === undefined ? (Math.abs(x) < 10 ? 1 : 0) : digits);
}

function pct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}

function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : (1000 * seconds).toFixed(seconds < 0.01 ? 1 : 0) + " ms";
}

function el(id) { return document.getElementById(id); }

// A time-series chart: series = [{label, stroke?, fill?}], push(t, values) adds a point and redraws.
class RollingChart {
  constructor(target, series, opts) {
    opts = opts || {};
    this.data = [[]].concat(series.map(() => []));
    const width = Math.max(300, target.clientWidth || 440);
    this.plot = new uPlot({
      width: width, height: opts.height || 180,
      scales: { x: { time: true }, y: opts.y || {} },
      axes: [{}, { size: 60, values: opts.yFormat ? (u, ticks) => ticks.map(opts.yFormat) : undefined }],
      series: [{}].concat(series.map((s, i) => ({
        label: s.label, stroke: s.stroke || COLOURS[i % COLOURS.length], width: 1.5,
        fill: s.fill, spanGaps: false, value: (u, v) => (opts.yFormat && v !== null ? opts.yFormat(v) : fmt(v)),
      }))),
    }, this.data, target);
    new ResizeObserver(() => this.plot.setSize({ width: Math.max(300, target.clientWidth), height: opts.height || 180 }))
      .observe(target);
  }
  push(t, values, redraw) {
    const times = this.data[0];
    if (times.length && t - times[times.length - 1] > GAP_SECONDS) {
      // nobody watched for a while (the server samples only for viewers): break the lines there
      this.data.forEach((col, i) => col.push(i === 0 ? times[times.length - 1] + 1 : null));
    }
    this.data[0].push(t);
    values.forEach((v, i) => this.data[i + 1].push(v === undefined ? null : v));
    if (this.data[0].length > WINDOW_POINTS) this.data.forEach(col => col.shift());
    if (redraw !== false) this.plot.setData(this.data);
  }
  redraw() { this.plot.setData(this.data); }
}

// Open an SSE stream and call handlers[event](data); reconnects (EventSource does) and shows the state.
function openStream(url, handlers, statusEl) {
  const source = new EventSource(url);
  source.onopen = () => { if (statusEl) statusEl.textContent = "live"; };
  source.onerror = () => { if (statusEl) statusEl.textContent = "disconnected, retrying…"; };
  Object.keys(handlers).forEach(name =>
    source.addEventListener(name, ev => handlers[name](JSON.parse(ev.data))));
  return source;
}
