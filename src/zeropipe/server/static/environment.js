// Environment page: the doctor's findings grouped by area.
"use strict";
(function () {
  const { el, api } = ZP;
  const AREAS = { gpu: "GPUs", cuda: "CUDA toolkit", cpu_adam: "DeepSpeed CPU Adam", versions: "Versions", memory: "Host memory", disk: "Disk", environment: "Environment" };
  const root = document.getElementById("doctor");

  function render(report) {
    if (!report.available) {
      root.replaceChildren(el("div", { class: "card muted", id: "doctor-unavailable" }, report.reason));
      return;
    }
    document.getElementById("checked-at").textContent = `checked ${ZP.fmtTime(report.checked_at)}`;
    const findings = (report.findings || []).map((f) => ({ ...f, area: f.area || String(f.id || "other").split(".")[0] }));
    const counts = ["error", "warning", "ok", "info"].map((s) => `${findings.filter((f) => f.status === s).length} ${s}`).join(" · ");
    const areas = [...new Set([...Object.keys(AREAS), ...findings.map((f) => f.area)])].filter((a) => findings.some((f) => f.area === a));
    root.replaceChildren(
      el("div", { class: "card" }, el("b", {}, counts)),
      ...areas.map((area) =>
        el(
          "div",
          { class: "card", dataset: { area } },
          el("h2", {}, AREAS[area] || area),
          findings
            .filter((f) => f.area === area)
            .map((f) =>
              el(
                "div",
                { class: "finding", dataset: { status: f.status } },
                el("span", { class: `badge sev-${f.status}` }, f.status),
                " ",
                el("b", {}, ZP.rich(f.title)),
                f.detail ? el("div", { class: "detail small" }, ZP.rich(f.detail)) : "",
                f.fix && f.status !== "ok" ? el("div", { class: "fix small" }, el("b", {}, "fix: "), ZP.rich(f.fix)) : ""
              )
            )
        )
      )
    );
  }

  async function load(check = null) {
    root.replaceChildren(el("div", { class: "card muted" }, check && check.trial_build ? "checking, with the CPU Adam build (about a minute the first time)…" : "checking this machine…"));
    try {
      render(check ? await api("/api/doctor/check", { method: "POST", body: check }) : await api("/api/doctor"));
    } catch (error) {
      root.replaceChildren(el("div", { class: "message error" }, error.message));
    }
  }

  document.getElementById("recheck").addEventListener("click", () => load({ trial_build: false }));
  document.getElementById("trial-build").addEventListener("click", () => load({ trial_build: true }));
  load();
})();
