// Runs page: the list, live from /api/runs/stream, with filters and selection for Compare.
"use strict";
(function () {
  const { el } = ZP;
  const body = document.querySelector("#runs tbody");
  const search = document.getElementById("search");
  const stateFilter = document.getElementById("state-filter");
  const compare = document.getElementById("compare");
  const empty = document.getElementById("empty");
  const selected = new Set();
  let runs = [];
  const deleted = new URLSearchParams(location.search).get("deleted");
  if (deleted) {
    const note = el("div", { id: "deleted-message" });
    document.querySelector("main").prepend(note);
    ZP.message(note, `Run ${deleted} was deleted, with its checkpoints.`, "ok");
    history.replaceState(null, "", "/");
  }

  function visible() {
    const needle = search.value.trim().toLowerCase();
    const states = stateFilter.value ? stateFilter.value.split(",") : null;
    return runs.filter((r) => (!needle || r.name.toLowerCase().includes(needle)) && (!states || states.includes(r.state)));
  }

  function row(run) {
    const box = el("input", {
      type: "checkbox",
      "aria-label": `select ${run.name}`,
      checked: selected.has(run.id),
      onchange: (e) => {
        e.target.checked ? selected.add(run.id) : selected.delete(run.id);
        compare.disabled = selected.size < 1;
      },
    });
    return el(
      "tr",
      { dataset: { runId: run.id, state: run.state } },
      el("td", {}, box),
      el("td", {}, el("a", { href: `/runs/${run.id}` }, run.name), run.origin === "ui" ? "" : el("span", { class: "muted small" }, " · cli")),
      el("td", {}, ZP.badge(run.state)),
      el("td", {}, ZP.progress(run)),
      el("td", { class: "num" }, ZP.fmtDuration(run.eta_s)),
      el("td", { class: "num" }, ZP.fmtNumber(run.last_loss)),
      el("td", {}, ZP.sparkline(run.loss_preview)),
      started(run),
      el("td", { class: "num small run-duration", title: "from the first start to the end (or now), pauses between a stop and a resume included" }, ZP.fmtDuration(run.duration_s)),
      el("td", { class: "small" }, run.world_size ? `${run.world_size} × ${run.accelerator || "?"} · ${run.zero_stage ?? "?"}` : "–")
    );
  }

  // When the run first started; a resume is said beside it, not in its place.
  function started(run) {
    const first = run.first_started_at || run.started_at || run.created_at;
    const resumed = run.started_at && first && run.started_at - first > 60 ? run.started_at : null;
    return el("td", { class: "small run-started" }, ZP.fmtTime(first), resumed ? el("div", { class: "muted" }, `resumed ${ZP.fmtTime(resumed)}`) : "");
  }

  function render() {
    const shown = visible();
    body.replaceChildren(...shown.map(row));
    empty.hidden = runs.length > 0;
  }

  search.addEventListener("input", render);
  stateFilter.addEventListener("change", render);
  compare.addEventListener("click", () => (location.href = `/compare?ids=${[...selected].join(",")}`));

  ZP.api("/api/runs").then((data) => {
    runs = data.runs;
    render();
  });
  ZP.stream("/api/runs/stream", {
    runs: (data) => {
      runs = data.runs;
      render();
    },
  });
})();
