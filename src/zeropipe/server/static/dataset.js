// Dataset page: a diffusion image/video folder as training reads it (buckets, captions, rejected files with why).
"use strict";
(function () {
  const { el, api } = ZP;
  const result = document.getElementById("ds-result");
  const status = document.getElementById("ds-status");
  const message = document.getElementById("ds-message");
  const field = (id) => document.getElementById(id);
  const PAGE = 24;
  let offset = 0;

  function request() {
    return {
      path: field("ds-path").value.trim(),
      caption_ext: field("ds-caption-ext").value.trim() || ".txt",
      resolution: Number(field("ds-resolution").value) || 1024,
      bucket_step: Number(field("ds-bucket-step").value) || 64,
      max_aspect: Number(field("ds-max-aspect").value) || 2,
      bucketing: field("ds-bucketing").checked,
      videos: field("ds-videos").checked,
      offset,
      limit: PAGE,
    };
  }

  async function look() {
    const body = request();
    if (!body.path) return ZP.message(message, "Name a folder first.");
    ZP.message(message, "");
    status.textContent = "reading the folder…";
    field("ds-open").disabled = true;
    const query = new URLSearchParams({ path: body.path, caption_ext: body.caption_ext, resolution: body.resolution, bucket_step: body.bucket_step, max_aspect: body.max_aspect, ...(body.videos ? { videos: "1" } : {}), ...(body.bucketing ? {} : { bucketing: "0" }) });
    history.replaceState(null, "", `/dataset?${query}`);
    try {
      render(await api("/api/dataset", { method: "POST", body }));
    } catch (error) {
      result.replaceChildren();
      message.replaceChildren(ZP.errorBox(error));
    } finally {
      status.textContent = "";
      field("ds-open").disabled = false;
    }
  }

  function render(data) {
    const bucketRows = Object.entries(data.buckets).map(([bucket, n]) => el("tr", { dataset: { bucket } }, el("td", {}, bucket.replace("x", " × ")), el("td", { class: "num" }, String(n.files)), el("td", { class: "num" }, String(n.samples))));
    const facts = [
      ["folder", data.folder],
      ["layout", data.layout],
      ["usable files", String(data.usable)],
      ["rejected", String(data.rejected_count)],
      ["without a caption", data.missing_captions_count ? `${data.missing_captions_count} (trained on the empty caption)` : "0"],
    ];
    if (data.unscanned) facts.push(["not read", `${data.unscanned} more files: one look decodes at most ${data.max_files}`]);
    const end = Math.min(data.offset + data.files.length, data.usable);
    const pager = el(
      "div",
      { class: "toolbar", style: "margin:6px 0" },
      el("span", { class: "muted small", id: "ds-range" }, data.usable ? `files ${data.offset + 1}–${end} of ${data.usable}` : "no usable file"),
      pagerButton("previous", data.offset > 0, () => (offset = Math.max(0, data.offset - PAGE))),
      pagerButton("next", end < data.usable, () => (offset = data.offset + PAGE))
    );
    result.replaceChildren(
      el(
        "div",
        { class: "row" },
        el("div", { class: "card", style: "flex:1" }, el("h2", {}, "Folder"), el("dl", { class: "kv" }, facts.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]))),
        el(
          "div",
          { class: "card", style: "flex:1", id: "ds-buckets" },
          el("h2", {}, data.bucketing ? `Buckets at ${data.resolution}` : `One size: ${data.resolution} × ${data.resolution}`),
          el("table", {}, el("thead", {}, el("tr", {}, el("th", {}, "bucket (w × h)"), el("th", {}, "files"), el("th", {}, "samples / epoch"))), el("tbody", {}, bucketRows))
        )
      ),
      el(
        "div",
        { class: "card", id: "ds-rejected-card" },
        el("h2", {}, `Rejected (${data.rejected_count})`),
        data.rejected.length
          ? el("table", { id: "ds-rejected" }, el("thead", {}, el("tr", {}, el("th", {}, "file"), el("th", {}, "why"))), el("tbody", {}, data.rejected.map((r) => el("tr", { dataset: { file: r.file } }, el("td", { class: "small" }, r.file), el("td", {}, r.reason)))))
          : el("div", { class: "muted" }, "Training would use every file it found.")
      ),
      el(
        "div",
        { class: "card" },
        el("h2", {}, "Files"),
        pager,
        el(
          "div",
          { class: "thumbs", id: "ds-files" },
          data.files.map((f) =>
            el(
              "figure",
              { class: "thumb", dataset: { file: f.file } },
              f.thumbnail ? el("img", { src: f.thumbnail, alt: f.caption }) : el("div", { class: "muted small" }, "(no thumbnail)"),
              el(
                "figcaption",
                {},
                el("div", { class: "small caption" }, f.caption || el("i", { class: "muted" }, "(no caption)")),
                el("div", { class: "small muted" }, `${f.file} · ${f.size.join("×")}${f.frames > 1 ? ` · ${f.frames} frames at ${f.fps} fps` : ""} → bucket ${f.bucket.join("×")}${f.repeats > 1 ? ` · ×${f.repeats}` : ""}`)
              )
            )
          )
        )
      )
    );
  }

  function pagerButton(label, enabled, move) {
    const button = el("button", { class: "small" }, label);
    button.disabled = !enabled;
    button.addEventListener("click", () => {
      move();
      look();
    });
    return button;
  }

  field("ds-open").addEventListener("click", () => {
    offset = 0;
    look();
  });
  field("ds-path").addEventListener("keydown", (event) => {
    if (event.key === "Enter") field("ds-open").click();
  });
  const params = new URLSearchParams(location.search);
  for (const [name, id] of [["path", "ds-path"], ["caption_ext", "ds-caption-ext"], ["resolution", "ds-resolution"], ["bucket_step", "ds-bucket-step"], ["max_aspect", "ds-max-aspect"]]) {
    if (params.get(name)) field(id).value = params.get(name);
  }
  if (params.get("videos") === "1") field("ds-videos").checked = true;
  if (params.get("bucketing") === "0") field("ds-bucketing").checked = false;
  if (params.get("path")) look();
})();
