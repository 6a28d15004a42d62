// Hand-written SVG charts: no library, nothing fetched. Every label is set with textContent.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 420, H = 180, L = 44, R = 10, T = 10, B = 24;
  const PALETTE = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00"];

  function svgEl(name, attrs, parent) {
    const el = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
    if (parent) parent.appendChild(el);
    return el;
  }

  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1000) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    return v.toFixed(2);
  }

  function figure(key, title, means) {
    const fig = document.createElement("figure");
    fig.className = "chart";
    fig.dataset.chart = key;
    const cap = document.createElement("figcaption");
    cap.textContent = title;
    fig.appendChild(cap);
    const svg = svgEl("svg", { class: "plot", viewBox: `0 0 ${W} ${H}` });
    fig.appendChild(svg);
    if (means) {
      const p = document.createElement("p");
      p.className = "means";
      p.textContent = means;
      fig.appendChild(p);
    }
    return [fig, svg];
  }

  function axes(svg, yMax, xLeft, xRight) {
    svgEl("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }, svg);
    svgEl("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }, svg);
    for (const [y, v] of [[T, yMax], [(T + H - B) / 2, yMax / 2], [H - B, 0]]) {
      const t = svgEl("text", { x: L - 4, y: y + 3, "text-anchor": "end" }, svg);
      t.textContent = fmt(v);
    }
    const a = svgEl("text", { x: L, y: H - 6 }, svg);
    a.textContent = xLeft;
    const b = svgEl("text", { x: W - R, y: H - 6, "text-anchor": "end" }, svg);
    b.textContent = xRight;
  }

  function empty(svg, why) {
    const t = svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, svg);
    t.textContent = why;
  }

  // series: [{name, points: [[x, y], ...]}]; x ascending.
  function lineChart(key, title, series, opts) {
    opts = opts || {};
    const [fig, svg] = figure(key, title, opts.means);
    const all = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
    if (all.length === 0) {
      empty(svg, opts.emptyText || "no data yet");
      return fig;
    }
    const xs = all.map((p) => p[0]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    const yMax = opts.yMax || Math.max(...all.map((p) => p[1]), 1e-9);
    axes(svg, yMax, opts.xLeft || "", opts.xRight || "");
    const sx = (x) => L + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - (Math.min(y, yMax) / yMax) * (H - T - B);
    const legend = document.createElement("div");
    legend.className = "legend";
    series.forEach((s, i) => {
      const color = PALETTE[i % PALETTE.length];
      const pts = s.points.filter((p) => p[1] !== null && p[1] !== undefined);
      if (pts.length === 0) return;
      const d = pts.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      const path = svgEl("path", { class: "line", d: d, stroke: color }, svg);
      const tip = svgEl("title", {}, path);
      tip.textContent = `${s.name}: last ${fmt(pts[pts.length - 1][1])}`;
      if (pts.length === 1) svgEl("circle", { class: "dot", cx: sx(pts[0][0]), cy: sy(pts[0][1]), r: 3, fill: color }, svg);
      const item = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.setAttribute("data-color", color);
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(s.name));
      legend.appendChild(item);
      swatch.style.background = color; // CSSOM, not a style attribute: allowed by the CSP
    });
    if (series.length > 1 || opts.legend) fig.insertBefore(legend, svg.nextSibling);
    return fig;
  }

  // bars: [{label, value, title}]
  function barChart(key, title, bars, opts) {
    opts = opts || {};
    const [fig, svg] = figure(key, title, opts.means);
    if (bars.length === 0 || bars.every((b) => !b.value)) {
      empty(svg, opts.emptyText || "no data yet");
      return fig;
    }
    const yMax = opts.yMax || Math.max(...bars.map((b) => b.value), 1e-9);
    axes(svg, yMax, "", "");
    const slot = (W - L - R) / bars.length;
    bars.forEach((b, i) => {
      const h = (Math.min(b.value, yMax) / yMax) * (H - T - B);
      const x = L + i * slot + slot * 0.1;
      const rect = svgEl("rect", { class: "bar", x: x, y: H - B - h, width: slot * 0.8, height: Math.max(h, 0), fill: PALETTE[0] }, svg);
      const tip = svgEl("title", {}, rect);
      tip.textContent = b.title || `${b.label}: ${fmt(b.value)}`;
      const t = svgEl("text", { x: x + slot * 0.4, y: H - B + 12, "text-anchor": "middle" }, svg);
      t.textContent = b.label.length > 14 ? b.label.slice(0, 13) + "…" : b.label;
    });
    return fig;
  }

  function sparkline(values) {
    const svg = svgEl("svg", { class: "spark", width: 90, height: 20, viewBox: "0 0 90 20" });
    const pts = values.map((v, i) => [i, v]).filter((p) => p[1] !== null);
    if (pts.length === 0) return svg;
    const n = Math.max(values.length - 1, 1);
    const d = pts.map((p, j) => `${j ? "L" : "M"}${(2 + (p[0] / n) * 86).toFixed(1)},${(18 - p[1] * 16).toFixed(1)}`).join(" ");
    svgEl("path", { d: d, fill: "none", stroke: PALETTE[0], "stroke-width": 1.5 }, svg);
    for (const p of pts) svgEl("circle", { cx: 2 + (p[0] / n) * 86, cy: 18 - p[1] * 16, r: 1.8, fill: PALETTE[0] }, svg);
    return svg;
  }

  window.Charts = { lineChart, barChart, sparkline, fmt };
})();
