"""``relax view RUN_DIR``: one static HTML report of a run (``RUN_DIR/report.html``) that opens without a server.

It embeds the run's plots (PNG as data URIs), its ``summary.txt`` and every sample of its samples files
(:mod:`relax_services.reporting.samples`), filterable by task and evaluation step with inline JavaScript; the
query string preselects the filters (``report.html?task=image&step=4``). Nothing is fetched from a network.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from relax_services.reporting.samples import read_samples

__all__ = ["PLOTS", "REPORT_NAME", "write_report"]

REPORT_NAME = "report.html"
PLOTS = ("reward.png", "staleness.png", "queue_depth.png")
"""The plots of a run folder the report embeds, in this order (those that exist)."""

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
pre { background: #f5f5f5; padding: .8em; overflow-x: auto; }
img.plot { max-width: 48%; margin: .3em; border: 1px solid #ddd; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ddd; padding: .3em .5em; vertical-align: top; text-align: left; }
td.text { white-space: pre-wrap; font-family: monospace; max-width: 40em; }
img.thumb { max-width: 96px; max-height: 96px; display: block; }
"""

_SCRIPT = """
(function () {
  const samples = JSON.parse(document.getElementById("samples-data").textContent);
  const taskSel = document.getElementById("task"), stepSel = document.getElementById("step");
  const body = document.getElementById("samples-body"), shown = document.getElementById("shown");
  function options(sel, values) {
    for (const v of values) { const o = document.createElement("option"); o.value = o.textContent = v; sel.append(o); }
  }
  options(taskSel, [...new Set(samples.map(s => s.task))].sort());
  options(stepSel, [...new Set(samples.map(s => s.version))].sort((a, b) => a - b).map(String));
  const query = new URLSearchParams(window.location.search);
  for (const [sel, key] of [[taskSel, "task"], [stepSel, "step"]]) {
    const v = query.get(key);
    if (v !== null && [...sel.options].some(o => o.value === v)) sel.value = v;
  }
  function cell(row, text, cls) {
    const td = row.insertCell(); td.textContent = text === null ? "n/a" : String(text);
    if (cls) td.className = cls;
    return td;
  }
  function render() {
    body.replaceChildren();
    const task = taskSel.value, step = stepSel.value;
    let n = 0;
    for (const s of samples) {
      if ((task && s.task !== task) || (step && String(s.version) !== step)) continue;
      const row = body.insertRow();
      row.className = "sample"; row.dataset.task = s.task; row.dataset.step = String(s.version);
      cell(row, s.version + (s.final ? " (final)" : ""));
      cell(row, s.staleness); cell(row, s.task); cell(row, s.reward);
      cell(row, s.prompt, "text"); cell(row, s.response, "text");
      const media = row.insertCell();
      for (const m of s.media || []) {
        if (m.thumbnail) { const img = document.createElement("img"); img.className = "thumb"; img.src = m.thumbnail;
          img.alt = m.kind; img.title = m.path; media.append(img); }
        else { const a = document.createElement("a"); a.href = m.copied ? m.path : "file://" + m.path;
          a.textContent = m.kind; a.title = m.path; media.append(a, " "); }
      }
      n += 1;
    }
    shown.textContent = String(n);
  }
  taskSel.addEventListener("change", render); stepSel.addEventListener("change", render);
  render();
})();
"""


def write_report(run_dir: Path) -> Path:
    """Writes ``run_dir/report.html`` from the run folder's plots, summary and samples; returns its path.

    Raises:
        FileNotFoundError: ``run_dir`` is not a folder.
    """
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder {str(run_dir)!r}")
    summary_file = run_dir / "summary.txt"
    summary = summary_file.read_text(encoding="utf-8") if summary_file.is_file() else "(no summary.txt: run unfinished)"
    plots = [
        f'<img class="plot" alt="{name}" src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}">'
        for name in PLOTS
        if (path := run_dir / name).is_file()
    ]
    samples = list(read_samples(run_dir))
    # "</" inside the JSON would end the script element early; "<\/" is the same string to JSON.parse
    data = json.dumps(samples, allow_nan=False).replace("</", "<\\/")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>relax run {html.escape(run_dir.name)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>relax run {html.escape(run_dir.name)}</h1>
<h2>Summary</h2>
<pre id="summary">{html.escape(summary)}</pre>
<h2>Plots</h2>
<div id="plots">{"".join(plots) or "<p>no plots in the run folder</p>"}</div>
<h2>Samples</h2>
<p>task <select id="task"><option value="">all</option></select>
step <select id="step"><option value="">all</option></select>
<span id="shown">0</span> of {len(samples)} samples shown</p>
<table><thead><tr><th>step</th><th>staleness</th><th>task</th><th>reward</th><th>prompt</th><th>response</th>
<th>media</th></tr></thead><tbody id="samples-body"></tbody></table>
<script type="application/json" id="samples-data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
    out = run_dir / REPORT_NAME
    out.write_text(page, encoding="utf-8")
    return out
