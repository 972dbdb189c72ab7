// Compare page: one metric of several runs overlaid (each run downsampled, joined on step).
"use strict";
(function () {
  const { el, api } = ZP;
  const params = new URLSearchParams(location.search);
  const selected = new Set((params.get("ids") || "").split(",").filter(Boolean).map(Number));
  const metric = document.getElementById("metric");
  const container = document.getElementById("compare-chart");
  let chart = null;
  window.zpCharts = {};

  function syncUrl() {
    const query = new URLSearchParams({ ids: [...selected].join(","), key: metric.value });
    history.replaceState(null, "", `/compare?${query}`);
  }

  // uPlot wants one x array: merge the runs' steps and leave gaps where a run has no point.
  function join(runs) {
    const steps = [...new Set(runs.flatMap((r) => r.step))].sort((a, b) => a - b);
    const position = new Map(steps.map((s, i) => [s, i]));
    const columns = runs.map((r) => {
      const column = new Array(steps.length).fill(null);
      r.step.forEach((s, i) => (column[position.get(s)] = r.values[i]));
      return column;
    });
    return [steps, columns];
  }

  async function draw() {
    syncUrl();
    container.replaceChildren();
    chart = null;
    const body = document.querySelector("#compare-table tbody");
    if (!selected.size) {
      container.replaceChildren(el("div", { class: "empty muted" }, "Pick runs on the left (or select them on the Runs page)."));
      body.replaceChildren();
      return;
    }
    const width = Math.max(400, container.clientWidth || 800);
    const note = document.getElementById("compare-missing");
    let data;
    try {
      data = await api(`/api/compare?ids=${[...selected].join(",")}&key=${encodeURIComponent(metric.value)}&width=${width}`);
    } catch (error) {
      if (error.status !== 404) throw error;
      data = { runs: [], missing: [...selected] }; // none of them is there any more
    }
    const missing = data.missing || [];
    note.hidden = !missing.length;
    note.textContent = missing.length ? `No run ${missing.join(", ")} (deleted, or never there): ${missing.length === 1 ? "it is" : "they are"} left out.` : "";
    if (!data.runs.length) {
      container.replaceChildren(el("div", { class: "empty muted" }, "None of these runs is there: pick runs on the left."));
      body.replaceChildren();
      return;
    }
    const [steps, columns] = join(data.runs);
    const labels = data.runs.map((r) => r.name);
    // Evaluations are at a few steps only: drawn as joined points, as on the run page.
    chart = new ZP.Chart(container, { title: metric.options[metric.selectedIndex].text, labels, height: 400, sparse: metric.value.startsWith("eval_") ? labels : [] });
    chart.set(steps, columns);
    window.zpCharts.compare = chart;
    body.replaceChildren(
      ...data.runs.map((r, i) => {
        const values = r.values.filter((v) => v !== null);
        return el(
          "tr",
          {},
          el("td", {}, el("span", { style: `color:${ZP.colors[i % ZP.colors.length]}` }, "■ "), el("a", { href: `/runs/${r.id}` }, r.name)),
          el("td", {}, ZP.badge(r.state)),
          el("td", { class: "num" }, r.step.length ? r.step[r.step.length - 1] : "–"),
          el("td", { class: "num" }, ZP.fmtNumber(values[0])),
          el("td", { class: "num" }, ZP.fmtNumber(values[values.length - 1])),
          el("td", { class: "num" }, values.length ? ZP.fmtNumber(Math.min(...values)) : "–")
        );
      })
    );
  }

  async function loadPicker() {
    const { runs } = await api("/api/runs");
    document.getElementById("picker").replaceChildren(
      ...runs.map((run) => {
        const box = el("input", { type: "checkbox", checked: selected.has(run.id), dataset: { runId: run.id } });
        box.addEventListener("change", () => {
          box.checked ? selected.add(run.id) : selected.delete(run.id);
          draw();
        });
        return el("label", { style: "display:block;padding:2px 0" }, box, " ", run.name, " ", ZP.badge(run.state));
      })
    );
  }

  if (params.get("key")) metric.value = params.get("key");
  metric.addEventListener("change", draw);
  loadPicker();
  draw().catch((error) => container.replaceChildren(el("div", { class: "message error" }, error.message)));
})();
