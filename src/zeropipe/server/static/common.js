// Helpers shared by every page: API calls, formatting, DOM building, charts, live streams.
"use strict";

const ZP = (window.ZP = {});

ZP.api = async function (path, options = {}) {
  const init = { headers: { Accept: "application/json" }, ...options };
  if (options.body !== undefined && typeof options.body !== "string") {
    init.body = JSON.stringify(options.body);
    init.headers["Content-Type"] = "application/json";
  }
  const response = await fetch(path, init);
  let data = null;
  try {
    data = await response.json();
  } catch (err) {
    data = { detail: response.statusText };
  }
  if (!response.ok) {
    const error = new Error((data && data.detail) || `HTTP ${response.status}`);
    error.status = response.status;
    error.data = data;
    throw error;
  }
  return data;
};

// el("div", {class: "x", onclick: fn}, "text", child, [more children])
ZP.el = function (tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "html") node.innerHTML = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
};

ZP.fmtNumber = function (value, digits = 4) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return Number(value.toPrecision(digits)).toString();
};

// Binary units, as the planner, the doctor and the diagnosis count memory (a "24 GB" card holds 24 GiB).
ZP.fmtBytes = function (value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = value;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${i === 0 ? v.toFixed(0) : Number(v.toPrecision(3))} ${units[i]}`;
};

ZP.fmtDuration = function (seconds) {
  if (seconds === null || seconds === undefined) return "–";
  seconds = Math.round(seconds);
  if (seconds < 60) return `${seconds}s`;
  const m = Math.floor(seconds / 60);
  if (m < 60) return `${m}m ${seconds % 60}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h ${m % 60}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
};

ZP.fmtTime = function (ts) {
  if (!ts) return "–";
  const d = new Date(ts * 1000);
  const sameDay = d.toDateString() === new Date().toDateString();
  return sameDay ? d.toLocaleTimeString() : d.toLocaleString();
};

ZP.badge = function (state) {
  return ZP.el("span", { class: `badge state-${state}`, dataset: { state } }, state);
};

ZP.progress = function (run) {
  const fraction = run.progress || 0;
  const label = run.total_steps ? `${run.step} / ${run.total_steps}` : `${run.step || 0}`;
  return ZP.el(
    "div",
    { class: "progress", title: `${Math.round(fraction * 100)}%` },
    ZP.el("div", { class: `bar state-${run.state}`, style: `width:${(fraction * 100).toFixed(1)}%` }),
    ZP.el("span", {}, label)
  );
};

// A small inline loss curve for tables: [[steps], [values]] -> <svg>.
ZP.sparkline = function (preview, width = 120, height = 28) {
  const svg = `http://www.w3.org/2000/svg`;
  const node = document.createElementNS(svg, "svg");
  node.setAttribute("width", width);
  node.setAttribute("height", height);
  node.setAttribute("class", "sparkline");
  if (!preview || !preview[0] || preview[0].length < 2) return node;
  const [xs, ys] = preview;
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => (x1 === x0 ? 0 : ((x - x0) / (x1 - x0)) * (width - 2) + 1);
  const sy = (y) => (y1 === y0 ? height / 2 : height - 2 - ((y - y0) / (y1 - y0)) * (height - 4));
  const line = document.createElementNS(svg, "polyline");
  line.setAttribute("points", xs.map((x, i) => `${sx(x).toFixed(1)},${sy(ys[i]).toFixed(1)}`).join(" "));
  node.append(line);
  return node;
};

ZP.colors = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

// A line chart (uPlot) over steps; `labels` name the y series.
ZP.Chart = class {
  // `sparse` labels have a value at a few steps only (evaluations): drawn as joined points.
  constructor(container, { title, labels, format = ZP.fmtNumber, height = 210, log = false, sparse = [] }) {
    this.container = container;
    this.labels = labels;
    this.data = [[], ...labels.map(() => [])];
    const width = Math.max(240, container.clientWidth || 480);
    this.plot = new uPlot(
      {
        title,
        width,
        height,
        scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
        series: [
          { label: "step" },
          ...labels.map((label, i) => {
            const few = sparse.includes(label);
            return { label, stroke: ZP.colors[i % ZP.colors.length], width: 1.5, spanGaps: few, points: { show: few, size: 6 } };
          }),
        ],
        axes: [{ label: "step" }, { size: 64, values: (u, values) => values.map((v) => format(v)) }],
        legend: { live: true },
        cursor: { drag: { x: true, y: false } },
      },
      this.data,
      container
    );
    container.dataset.points = "0";
    ZP.charts.push(this);
  }
  set(steps, columns) {
    this.data = [steps.slice(), ...columns.map((c) => c.slice())];
    this.redraw();
  }
  append(steps, columns) {
    this.data[0].push(...steps);
    columns.forEach((column, i) => this.data[i + 1].push(...column));
    this.redraw();
  }
  redraw() {
    this.plot.setData(this.data);
    this.container.dataset.points = String(this.data[0].length);
  }
  resize() {
    const width = Math.max(240, this.container.clientWidth || 480);
    this.plot.setSize({ width, height: this.plot.height });
  }
};
ZP.charts = [];
let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => ZP.charts.forEach((c) => c.resize()), 150);
});

// The dot in the header: green while the server answers (live updates flowing, or a health
// check every few seconds on pages without a stream), amber when it does not. It is never
// left grey on a page where nothing is wrong.
ZP.setConnection = function (ok, title) {
  const dot = document.getElementById("connection");
  if (!dot) return;
  dot.className = `connection ${ok ? "live" : "down"}`;
  dot.title = title;
  dot.dataset.state = ok ? "live" : "down";
};
ZP.openStreams = 0;
ZP.checkConnection = async function () {
  try {
    const response = await fetch("/api/health", { cache: "no-store" });
    ZP.setConnection(response.ok, response.ok ? "connected to the server" : `the server answered ${response.status}`);
  } catch (error) {
    ZP.setConnection(false, "the server does not answer (stopped?): this page retries by itself");
  }
};
ZP.checkConnection();
setInterval(() => ZP.openStreams || ZP.checkConnection(), 10000);

// Server-sent events, which keep the connection dot up to date while they are open.
ZP.stream = function (url, handlers) {
  const source = new EventSource(url);
  let open = false;
  source.onopen = () => {
    if (!open) ZP.openStreams++;
    open = true;
    ZP.setConnection(true, "live updates");
  };
  source.onerror = () => {
    if (open) ZP.openStreams--;
    open = false;
    // A stream the server ended (the run finished) is not a lost connection: ask the server.
    ZP.checkConnection();
  };
  const close = source.close.bind(source);
  source.close = () => {
    if (open) ZP.openStreams--;
    open = false;
    close();
  };
  for (const [event, handler] of Object.entries(handlers)) {
    source.addEventListener(event, (message) => handler(JSON.parse(message.data)));
  }
  return source;
};

// Messages are written once for the terminal and the pages (the diagnosis, check findings, the
// doctor). On a page, say the page's button instead of the command-line flag, and show
// `code` as code rather than as literal backticks.
const UI_WORDING = [
  [/\b(?:then )?resume with --resume once the cause is fixed\b/g, "once the cause is fixed, resume the run (Resume, at the top of its page)"],
  [/\b(then )?resume with --resume\b/g, "$1resume the run (Resume, at the top of its page)"],
  [/\bfrom the last complete checkpoint with --resume\b/g, "from its last complete checkpoint (Resume)"],
  [/\bwith --resume\b/g, "with Resume"],
  [/--no-build was given/g, "the build was not tried (Check again with the CPU Adam build tries it)"],
];
ZP.uiText = function (text) {
  if (typeof text !== "string") return text;
  return UI_WORDING.reduce((out, [pattern, replacement]) => out.replace(pattern, replacement), text);
};
// Text with `code` spans as <code> elements (and the page's wording).
ZP.rich = function (text) {
  if (typeof text !== "string") return text;
  return ZP.uiText(text).split(/`([^`\n]+)`/).map((part, i) => (i % 2 ? ZP.el("code", {}, part) : part));
};

ZP.message = function (container, text, kind = "error") {
  container.replaceChildren(text ? ZP.el("div", { class: `message ${kind}` }, text) : "");
};

ZP.problemList = function (problems) {
  return ZP.el("ul", { class: "problems" }, problems.map((p) => ZP.el("li", {}, p.key ? ZP.el("code", {}, p.key) : "", p.key ? ": " : "", ZP.rich(p.message))));
};

// The error of a failed API call, with its problem list or check findings when there are some.
ZP.errorBox = function (error) {
  const data = error.data || {};
  return ZP.el(
    "div",
    { class: "message error" },
    ZP.el("div", {}, data.problems || data.findings ? (error.status === 422 ? "The config would not run:" : ZP.rich(error.message)) : ZP.rich(error.message)),
    data.problems ? ZP.problemList(data.problems) : "",
    data.findings ? ZP.problemList(data.findings.filter((f) => f.severity === "error").map((f) => ({ key: f.key, message: `${f.message} — fix: ${f.fix}` }))) : ""
  );
};
