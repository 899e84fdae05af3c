// phasemech explain page: reads the JSON embedded in #phasemech-data, draws with plotly.js.
// The figures are drawn in Python (phasemech.viz.explain.explain_figures) and only replayed
// here; this script fills the summary strip and the clicked head's side panel.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("phasemech-data").textContent);
  const $ = (id) => document.getElementById(id);
  const H = D.heads;
  const st = { label: null };
  const cfg = { displaylogo: false, responsive: true };
  const font = { family: "Helvetica, Arial, sans-serif", size: 12 };
  const fmt = (x, nd = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(nd));
  const ci = (lo, hi, nd = 3) => `[${fmt(lo, nd)}, ${fmt(hi, nd)}]`;
  const esc = (x) => String(x).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const phases = () => Array.from({ length: D.stride }, (_, p) => p);
  const copy = (x) => JSON.parse(JSON.stringify(x));

  function renderMeta() {
    const m = D.meta;
    $("meta").textContent = `regime ${m.regime} · context ${m.context} tokens · task ${m.task} · ${m.contents} contents × ${D.stride} phases = ${D.n_prompts} prompts · seed ${m.seed}`;
  }
  function renderSummary() {
    const cells = [];
    (D.accuracy || []).forEach((a, p) => {
      cells.push(`<span class="cell phase" data-phase="${p}">φ${p} design <b>${fmt(a, 2)}</b> (null ${fmt(D.null[p], 2)})</span>`);
    });
    if (D.contrast && D.contrast[0] !== null) {
      cells.push(`<span class="cell" id="sum-contrast">patching: clean φ${D.contrast[0]} → corrupted φ${D.contrast[1]}, ${D.n_pairs} pairs</span>`);
    }
    const a = D.atp_check;
    if (a) {
      cells.push(`<span class="cell" id="sum-atp">AtP vs exact on its top ${a.n}: r ${fmt(a.pearson_r, 2)}, ${a.overlap} shared</span>`);
    }
    if (D.phase_test) {
      // the smallest p the per-head phase test could give: a table of p-values means little without it
      cells.push(`<span class="cell" id="sum-phase-test">phase dependence per head: ${D.phase_test}</span>`);
    }
    $("summary").innerHTML = cells.join("");
  }
  function draw(id, fig) {
    const f = copy(fig);
    return Plotly.react($(id), f.data, f.layout, cfg);
  }

  // ------------------------------------------------------------------ head side panel
  function renderNumbers(i) {
    const hasMean = !!H.mean;
    const head = ["phase", "zero abl. Δ margin [95% CI]"];
    if (hasMean) head.push("mean abl. Δ margin [95% CI]");
    head.push("attention null", "attention design");
    const rows = [`<tr>${head.map((h) => `<th>${h}</th>`).join("")}</tr>`];
    phases().forEach((p) => {
      const cell = (m) => `${fmt(m.effect[i][p])} ${ci(m.ci_low[i][p], m.ci_high[i][p])}`;
      const att = (a) => (a ? fmt(a[i][p]) : "–");
      const tds = [String(p)];
      tds.push(H.zero ? cell(H.zero) : "–");
      if (hasMean) tds.push(cell(H.mean));
      tds.push(att(H.attention_null), att(H.attention_design));
      rows.push(`<tr data-phase="${p}">${tds.map((x) => `<td>${x}</td>`).join("")}</tr>`);
    });
    $("head-numbers").innerHTML = rows.join("");
    const patch = H.patch ? `exact patching ${fmt(H.patch.effect[i])} ${ci(H.patch.ci_low[i], H.patch.ci_high[i])}` : "no patching";
    const atp = H.atp ? ` · AtP ${fmt(H.atp.effect[i])}` : "";
    $("head-patch").textContent = `${patch}${atp} (1 = the clean phase restored)`;
  }
  function renderPlots(i) {
    const traces = [];
    ["zero", "mean"].forEach((mode, k) => {
      const m = H[mode];
      if (!m) return;
      const y = m.effect[i];
      traces.push({ type: "scatter", mode: "markers", name: `${mode} ablation`, x: phases().map((p) => p + (k ? 0.1 : -0.1)), y,
        error_y: { type: "data", symmetric: false, array: y.map((v, p) => m.ci_high[i][p] - v), arrayminus: y.map((v, p) => v - m.ci_low[i][p]) },
        hovertemplate: `${mode} ablation<br>phase %{x:.0f}<br>Δ margin %{y:.3f}<extra></extra>` });
    });
    Plotly.react($("head-plot"), traces, { font, height: 260, margin: { l: 55, r: 10, t: 30, b: 80 },
      title: { text: `${esc(st.label)}: ablation effect by phase`, font: { size: 12 } },
      legend: { orientation: "h", y: -0.4 }, xaxis: { tickvals: phases(), title: { text: "needle phase" } },
      yaxis: { title: { text: "Δ margin" }, zeroline: true } }, cfg);
    const bars = [["null", H.attention_null, "#000000"], ["design", H.attention_design, "#D55E00"]]
      .filter((b) => b[1]).map(([name, a, color]) => ({ type: "bar", name, x: phases(), y: a[i], marker: { color },
        hovertemplate: `${name}<br>phase %{x}<br>attention %{y:.3f}<extra></extra>` }));
    Plotly.react($("head-attention"), bars, { font, height: 240, barmode: "group", margin: { l: 55, r: 10, t: 30, b: 80 },
      title: { text: `${esc(st.label)}: attention onto the needle`, font: { size: 12 } },
      legend: { orientation: "h", y: -0.45 }, xaxis: { tickvals: phases(), title: { text: "needle phase" } },
      yaxis: { rangemode: "tozero" } }, cfg);
  }
  function selectHead(label) {
    const i = H.labels.indexOf(label);
    if (i < 0) return;
    st.label = label;
    $("head-title").textContent = label;
    $("head-title").dataset.layer = H.layer[i];
    $("head-title").dataset.head = H.head[i];
    $("head-sub").textContent = "ablation, patching, attention";
    renderNumbers(i);
    renderPlots(i);
  }

  // ------------------------------------------------------------------ wiring
  renderMeta();
  renderSummary();
  Object.entries(D.figures).forEach(([name, fig]) => draw(`${name}-plot`, fig));
  if (H) {
    selectHead(H.initial);
    if (D.figures.ablation) {
      $("ablation-plot").on("plotly_click", (ev) => selectHead(String(ev.points[0].y)));
    }
    if (D.figures.patching) {
      // exact and AtP panels: a cell is (head, layer)
      $("patching-plot").on("plotly_click", (ev) => selectHead(`L${ev.points[0].y}H${ev.points[0].x}`));
    }
  } else {
    $("head-panel").hidden = true;
  }
  window.phasemechExplain = { state: st, data: D, selectHead };
})();
