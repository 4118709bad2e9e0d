"""The report's page: one fixed `index.html` (plain HTML, CSS and JavaScript, no library, nothing fetched from the
network). Its data comes as script files that call the page's `VIEW` object, so it works from file:// as well as
from `mmpack view --serve`: `overview.js`, `problems.js`, then on demand `bins/p<page>.js`, `ids/h<bucket>.js` and
`bin/b<bin>.js`.

What a test or a script can read from the DOM: `#bin` (`data-bin`), `.sample` (`data-sample-id`, `data-source`),
`.tok` (`data-id`, `data-trained` "1"/"0", class `trained`, `title` with its position ids), `figure.media`
(`data-kind`, `data-grid`, `data-tokens`), `#rejects tr.reject` (`data-reason`), `#problems li.problem`; for a
mixture `#sources tr.source` (`data-source`), `#bins td.source` and `#bin` (`data-mixture-source`)."""

from __future__ import annotations

INDEX_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>mmpack view</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
header { background: #1d2330; color: #fff; padding: 8px 16px; display: flex; gap: 16px; align-items: center; }
header h1 { font-size: 16px; margin: 0; }
header input { width: 320px; padding: 3px 6px; }
main { display: grid; grid-template-columns: 430px 1fr; gap: 12px; padding: 12px; }
section { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 10px 12px; margin-bottom: 12px; }
h2 { font-size: 15px; margin: 0 0 8px; }
table { border-collapse: collapse; width: 100%; font-size: 12px; }
td, th { padding: 2px 6px; border-bottom: 1px solid #eef0f3; text-align: left; vertical-align: top; }
th { color: #5a6475; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
#bins tr { cursor: pointer; }
#bins tr.current { background: #e4ecff; }
.fill { width: 80px; height: 9px; background: #e6e8ec; border-radius: 2px; display: inline-block; }
.fill b { display: block; height: 100%; background: #55a868; border-radius: 2px; }
.pager { display: flex; gap: 6px; align-items: center; margin: 6px 0; }
.plot { max-width: 100%; }
.problem { color: #a12a2a; }
#problems:empty::after { content: "none"; color: #6a7383; }
.sample { border-left: 4px solid #8aa4d6; margin: 10px 0; padding: 2px 0 2px 10px; }
.sample:nth-child(even) { border-left-color: #d69a8a; }
.sample.highlight { background: #fff7d6; }
.sample.dropped { border-left-color: #a12a2a; }
.sample .head { font-size: 12px; color: #5a6475; margin-bottom: 4px; }
.text { font: 13px/1.7 ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
.tok { border-radius: 2px; }
.tok:hover { outline: 1px solid #1d2330; }
.tok.trained { background: #c9efcf; }
.tok.sp { background: #e7e2f7; color: #4b3a8c; font-size: 11px; }
.tok.sp.trained { background: #9bd9a6; }
figure.media { display: inline-block; margin: 4px; padding: 4px; border: 1px dashed #8c8fa0; vertical-align: top; }
figure.media img { display: block; image-rendering: pixelated; max-width: 448px; }
figure.media figcaption { font: 11px system-ui, sans-serif; color: #5a6475; }
.pads { line-height: 6px; max-width: 448px; }
.pads .tok { display: inline-block; width: 5px; height: 5px; margin: 0 1px 1px 0; overflow: hidden;
  color: transparent; font-size: 1px; background: #b8b1d8; vertical-align: top; }
.legend span { margin-right: 10px; padding: 0 4px; }
.muted { color: #6a7383; }
</style>
</head>
<body>
<header><h1>mmpack view</h1><span id="path" class="muted"></span>
<input id="search" placeholder="sample id or bin number, then Enter"><span id="found" class="muted"></span></header>
<main>
<div>
<section><h2>Overview</h2><div id="overview">loading overview.js ...</div></section>
<section><h2>Bins</h2><div class="pager"><button id="prev">&lt;</button><span id="pageinfo"></span>
<button id="next">&gt;</button></div><table id="bins"></table></section>
<section><h2>Rejects</h2><div id="rejects-by-reason"></div><table id="rejects"></table></section>
<section><h2>Problems</h2><ul id="problems"></ul></section>
</div>
<div>
<section><div class="legend"><span class="tok trained">trained token</span><span class="tok">context</span>
<span class="tok sp">special</span> <span class="muted">hover a token for its position ids</span></div>
<div id="bin">no bin loaded</div></section>
</div>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
}
function fmt(n) { return n === null || n === undefined ? "-" : Number(n).toLocaleString("en"); }
function show(v) {
  if (typeof v === "number") return Number.isInteger(v) ? fmt(v) : String(Math.round(v * 100) / 100);
  if (v && typeof v === "object") return Object.entries(v).map(([k, x]) => k + " " + show(x)).join(", ");
  return v === null || v === undefined ? "-" : String(v);
}
function pct(x) { return x === null || x === undefined ? "-" : (100 * x).toFixed(2) + "%"; }
const VIEW = {
  ov: null, pages: {}, idTables: {}, waiting: {}, page_no: 0, current: null, wanted: null,
  load(src, key) {
    return new Promise((resolve, reject) => {
      this.waiting[key] = resolve;
      const s = el("script", { src: src });
      s.onerror = () => { delete this.waiting[key]; reject(new Error("cannot load " + src)); };
      document.body.append(s);
    });
  },
  done(key, value) { const r = this.waiting[key]; delete this.waiting[key]; if (r) r(value); },
  overview(d) { this.ov = d; renderOverview(d); this.done("overview", d); },
  problems(list) {
    const ul = $("problems"); ul.textContent = "";
    for (const p of list) ul.append(el("li", { class: "problem", text: p }));
  },
  page(n, rows) { this.pages[n] = rows; this.done("p" + n, rows); },
  ids(b, table) { this.idTables[b] = table; this.done("h" + b, table); },
  bin(d) { this.done("b" + d.bin, d); },
};
function pad(n, w) { return String(n).padStart(w, "0"); }
function renderOverview(d) {
  $("path").textContent = d.path;
  const m = d.manifest, c = m.counts || {}, s = d.stats;
  const rows = [
    ["format", (d.format || "-") + " (manifest version " + m.version + ")"],
    ["bins of", fmt(m.seq_len) + " tokens"], ["bins", fmt(d.num_bins)], ["shards", fmt(d.num_shards)],
    ["samples packed / read", fmt(c.samples_packed) + " / " + fmt(c.samples_read)],
    ["tokens", fmt(c.tokens)], ["image tokens", fmt(c.image_tokens)],
    ["videos", fmt(c.videos)], ["truncated", fmt(c.truncated)],
    ["tokenizer", (m.tokenizer || {}).name], ["chat template", show(m.chat_template)],
    ["algorithm", show(m.algorithm)], ["created by", m.created_by],
  ];
  if (s) {
    rows.push(["fill efficiency", pct(s.fill_efficiency)], ["L2 lower bound", fmt(s.l2_lower_bound_bins) + " bins"],
      ["fill histogram", show(s.fill_histogram)], ["samples per bin", show(s.samples_per_bin)],
      ["images per bin", show(s.images_per_bin)]);
    const ld = s.length_distribution;
    if (ld) rows.push(["sample length", show({ min: ld.min, p50: ld.p50, p90: ld.p90, max: ld.max })]);
  } else rows.push(["stats", d.stats_error ? "not available: " + d.stats_error :
    "being computed (mmpack stats); reload when mmpack view has finished"]);
  const t = el("table", { id: "stats" });
  for (const [k, v] of rows) t.append(el("tr", { "data-key": k }, el("th", { text: k }), el("td", { text: String(v) })));
  const box = $("overview"); box.textContent = ""; box.append(t);
  if (d.sources.length) {
    const mt = el("table", { id: "sources" });
    mt.append(el("tr", {}, ...["source", "path", "weight / repeat", "share", "bins", "first bin", "samples packed / read",
      "images", "videos", "fill", "rejects by reason"].map((h) => el("th", { text: h }))));
    const num = (k, v) => el("td", { class: "num", "data-key": k, text: v });
    for (const x of d.sources) {
      const f = x.figures || {}, has = f.samples !== undefined, reasons = Object.entries(f.rejected_by_reason || {});
      mt.append(el("tr", { class: "source", "data-source": x.name }, el("td", { text: x.name }), el("td", { text: x.path }),
        el("td", { text: x.weight !== null ? "weight " + show(x.weight) : "repeat " + show(x.repeat) }),
        num("share", pct(x.share)), num("bins", fmt(x.bins)), num("first-bin", fmt(x.first_bin)),
        num("samples", fmt(f.samples_packed) + " / " + fmt(f.samples_read)),
        num("images", has ? fmt(f.images) : "-"), num("videos", has ? fmt(f.videos) : "-"),
        num("fill", has ? pct(f.fill_efficiency) : "-"),
        el("td", { "data-key": "rejects", text: reasons.length ? reasons.map(([k, v]) => k + " " + fmt(v)).join(", ")
          : fmt(f.samples_rejected || 0) })));
    }
    box.append(el("h2", { text: "Mixture: " + d.sources.length + " sources, bins numbered through them in order "
      + "(each source's own mmpack stats figures; the table above sums them)" }), mt);
  }
  if (d.plot) box.append(el("img", { class: "plot", src: d.plot, alt: "mmpack stats plot" }));
  if (s && s.dataset && s.dataset.shards) {
    const st = el("table", { id: "shards" });
    st.append(el("tr", {}, ...["shard", "bins", "samples", "images", "fill"].map((h) => el("th", { text: h }))));
    for (const sh of s.dataset.shards)
      st.append(el("tr", {}, el("td", { text: sh.path }), el("td", { class: "num", text: fmt(sh.bins) }),
        el("td", { class: "num", text: fmt(sh.samples) }), el("td", { class: "num", text: fmt(sh.images) }),
        el("td", { class: "num", text: pct(sh.fill_efficiency) })));
    box.append(el("h2", { text: "Sources (first " + s.dataset.shards.length + " shards)" }), st);
  }
  const r = d.rejects, by = $("rejects-by-reason"); by.textContent = "";
  const bt = el("table", { id: "rejects-reasons" });
  for (const [k, v] of Object.entries(r.by_reason)) bt.append(el("tr", {}, el("th", { text: k }), el("td", { class: "num", text: fmt(v) })));
  by.append(el("div", { class: "muted", text: fmt(r.total) + " rejected" + (r.first.length < r.total ? ", first " + r.first.length + " listed (all in " + r.file + ")" : "") }), bt);
  const rt = $("rejects"); rt.textContent = "";
  rt.append(el("tr", {}, ...["record", "reason", "file", "message"].map((h) => el("th", { text: h }))));
  for (const x of r.first)
    rt.append(el("tr", { class: "reject", "data-reason": x.reason }, el("td", { text: x.sample_id || "" }),
      el("td", { text: x.reason }), el("td", { text: x.source + (x.line ? ":" + x.line : "") }),
      el("td", { text: x.message || "" })));
}
function sourceOf(bin) {
  const x = VIEW.ov.sources.find((s) => s.first_bin <= bin && bin < s.first_bin + s.bins);
  return x ? x.name : "";
}
function pages() { return Math.max(1, Math.ceil(VIEW.ov.num_bins / VIEW.ov.page_size)); }
async function showPage(n) {
  n = Math.max(0, Math.min(n, pages() - 1));
  let rows = VIEW.pages[n];
  if (!rows) rows = await VIEW.load("bins/p" + pad(n, 6) + ".js", "p" + n);
  VIEW.page_no = n;
  $("pageinfo").textContent = "page " + (n + 1) + " of " + fmt(pages());
  const t = $("bins"); t.textContent = "";
  const mixed = VIEW.ov.sources.length > 0;
  const heads = ["bin", "fill", "samples", "images", "videos", "key"].concat(mixed ? ["source"] : []);
  t.append(el("tr", {}, ...heads.map((h) => el("th", { text: h }))));
  for (const [bin, key, tokens, samples, images, videos] of rows) {
    const f = el("span", { class: "fill", title: fmt(tokens) + " / " + fmt(VIEW.ov.manifest.seq_len) + " tokens" },
      el("b", { style: "width:" + (100 * tokens / VIEW.ov.manifest.seq_len).toFixed(1) + "%" }));
    const tr = el("tr", { "data-bin": bin, class: bin === VIEW.current ? "current" : "" },
      el("td", { class: "num", text: fmt(bin) }), el("td", {}, f), el("td", { class: "num", text: fmt(samples) }),
      el("td", { class: "num", text: fmt(images) }), el("td", { class: "num", text: fmt(videos) }),
      el("td", { text: key === null ? "(shard missing)" : key }));
    if (mixed) tr.append(el("td", { class: "source", text: sourceOf(bin) }));
    tr.onclick = () => showBin(bin);
    t.append(tr);
  }
}
function fnv1a(s) {
  let h = 0x811c9dc5;
  for (const b of new TextEncoder().encode(s)) h = Math.imul(h ^ b, 0x01000193) >>> 0;
  return h;
}
async function search(q) {
  q = q.trim(); if (!q) return;
  if (/^\d+$/.test(q) && Number(q) < VIEW.ov.num_bins) { $("found").textContent = ""; return showBin(Number(q)); }
  const b = fnv1a(q) % VIEW.ov.id_buckets;
  let table = VIEW.idTables[b];
  if (!table) table = await VIEW.load("ids/h" + pad(b, 4) + ".js", "h" + b);
  if (!(q in table)) { $("found").textContent = "no sample " + q; return; }
  $("found").textContent = "sample " + q + " is in bin " + table[q];
  VIEW.wanted = q;
  return showBin(table[q]);
}
async function showBin(bin) {
  VIEW.current = bin;
  location.hash = "bin=" + bin;
  const page = Math.floor(bin / VIEW.ov.page_size);
  if (page !== VIEW.page_no || !$("bins").children.length) await showPage(page);
  for (const tr of $("bins").querySelectorAll("tr[data-bin]")) tr.classList.toggle("current", Number(tr.dataset.bin) === bin);
  const box = $("bin"); box.textContent = "loading bin " + bin + " ...";
  let d;
  try { d = await VIEW.load("bin/b" + pad(bin, 9) + ".js", "b" + bin); }
  catch (e) {
    box.textContent = "bin " + bin + " was not written: run mmpack view with --bin " + bin + ", or with --serve";
    return;
  }
  renderBin(d);
}
function posTitle(d, j) {
  const p = d.pos.map((axis) => axis[j]);
  return "#" + j + " id " + d.ids[j] + (p.length === 3 ? " · t " + p[0] + " h " + p[1] + " w " + p[2] : " · pos " + p[0]);
}
function renderBin(d) {
  const box = $("bin"); box.textContent = "";
  box.setAttribute("data-bin", d.bin);
  box.setAttribute("data-mixture-source", d.source || "");
  const trained = new Set(d.trained), special = new Set(d.special);
  const media = new Map(d.media.map((m) => [m.at, m]));
  const n = d.ids.length;
  box.append(el("h2", { text: "bin " + d.bin + " · " + d.key + (d.source ? " · source " + d.source : "") + " · " + d.shard }),
    el("div", { class: "muted", text: fmt(n) + " / " + fmt(d.seq_len) + " tokens, " + d.samples.length +
      " samples, " + d.media.length + " images / video steps, " + d.trained.length + " trained tokens" }));
  d.samples.forEach((s, i) => {
    const div = el("div", { class: "sample" + (s.dropped ? " dropped" : "") + (s.id === VIEW.wanted ? " highlight" : ""),
      "data-sample-id": s.id, "data-source": s.source });
    div.append(el("div", { class: "head", text: "sample " + i + ": " + s.id + (s.source ? " · file " + s.source : "") +
      " · " + s.len + " tokens, " + s.trained + " trained" + (s.dropped ? " · DROPPED by the loader: " + s.dropped : "") }));
    const text = el("div", { class: "text" });
    let target = text, left = 0;
    for (let j = s.start; j < s.start + s.len; j++) {
      const m = media.get(j);
      if (m) {
        const fig = el("figure", { class: "media", "data-kind": m.kind, "data-grid": m.grid.join("x"), "data-tokens": m.tokens });
        const zoom = Math.max(1, Math.min(4, Math.floor(168 / Math.max(m.size[0], m.size[1]))));
        for (const f of m.files)
          fig.append(el("img", { src: f, width: m.size[0] * zoom, height: m.size[1] * zoom, alt: m.kind }));
        fig.append(el("figcaption", { text: m.kind + " " + m.index + (m.kind === "video" ? " step " + m.step : "") +
          " · grid t×h×w " + m.grid.join("×") + " · " + m.tokens + " tokens · " + m.size[0] + "×" + m.size[1] + " px" }));
        const pads = el("div", { class: "pads" });
        fig.append(pads); text.append(fig); target = pads; left = m.run;
      }
      const id = d.ids[j], tr = trained.has(j);
      target.append(el("span", { class: "tok" + (special.has(id) ? " sp" : "") + (tr ? " trained" : ""),
        "data-id": id, "data-trained": tr ? "1" : "0", title: posTitle(d, j), text: d.pieces[id] }));
      if (left > 0 && --left === 0) target = text;
    }
    div.append(text);
    box.append(div);
  });
  if (n < d.seq_len) box.append(el("div", { class: "muted", text: "padding: " + fmt(d.seq_len - n) + " tokens (no loss)" }));
  const hit = box.querySelector(".sample.highlight");
  if (hit) hit.scrollIntoView();
}
$("prev").onclick = () => showPage(VIEW.page_no - 1);
$("next").onclick = () => showPage(VIEW.page_no + 1);
$("search").onkeydown = (e) => { if (e.key === "Enter") search(e.target.value); };
async function start() {
  await new Promise((r) => (VIEW.ov ? r() : (VIEW.waiting.overview = r)));
  const m = /bin=(\d+)/.exec(location.hash), q = /id=([^&]+)/.exec(location.hash);
  const first = m ? Number(m[1]) : VIEW.ov.rendered.length ? VIEW.ov.rendered[0] : 0;
  if (q) await search(decodeURIComponent(q[1]));  // index.html#id=SAMPLE: the bin of that sample
  else if (VIEW.ov.num_bins) await showBin(first);
  document.body.setAttribute("data-ready", "1");
}
start();
</script>
<script src="overview.js"></script>
<script src="problems.js"></script>
</body>
</html>
"""
