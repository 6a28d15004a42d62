// The run viewer's pages. Everything a rollout contains is untrusted: it reaches the page only as
// text (textContent, createTextNode, attribute values), never as markup.
"use strict";
(function () {
  const KEY = "rollout-viewer-key";
  const API = "/ui/api";
  const main = document.getElementById("main");
  let timer = null;
  let drawing = 0; // bumped by each route(): an answer for an earlier one is dropped, not drawn

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined) node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    return node;
  }

  const fmt = (v) => window.Charts.fmt(v);
  const pct = (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(0)}%`);

  class Unauthorized extends Error {}
  class Stale extends Error {}

  async function get(path) {
    const mine = drawing;
    const key = sessionStorage.getItem(KEY);
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const answer = await fetch(API + path, { headers: headers, cache: "no-store" });
    if (answer.status === 401) throw new Unauthorized("the service wants the API key");
    const body = await answer.json();
    // The page moved on while this was on its way (a slow overview refresh, then a click on Groups):
    // drawing it now would put the old page over the new one.
    if (mine !== drawing) throw new Stale();
    if (!answer.ok) throw new Error(body.message || `HTTP ${answer.status}`);
    return body;
  }

  function askKey(why) {
    const form = document.getElementById("keyform");
    document.getElementById("keywhy").textContent = why;
    form.hidden = false;
    document.getElementById("key").focus();
  }

  document.getElementById("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY, document.getElementById("key").value);
    document.getElementById("key").value = "";
    document.getElementById("keyform").hidden = true;
    route();
  });
  document.getElementById("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    askKey("Key forgotten: enter it again to read the run.");
  });

  function show(...nodes) {
    main.replaceChildren(...nodes);
  }

  // -- overview -----------------------------------------------------------------------------

  function rates(samples, field) {
    const out = [];
    for (let i = 1; i < samples.length; i++) {
      const dt = samples[i].t - samples[i - 1].t;
      if (dt > 0) out.push([samples[i].t, (samples[i][field] - samples[i - 1][field]) / dt]);
    }
    return out;
  }

  function perKey(samples, field) {
    const names = new Set(samples.flatMap((s) => Object.keys(s[field])));
    return [...names].map((name) => ({ name: name, points: samples.filter((s) => name in s[field]).map((s) => [s.t, s[field][name]]) }));
  }

  function ago(samples) {
    if (samples.length < 2) return ["", ""];
    return [`${Math.round(samples[samples.length - 1].t - samples[0].t)}s ago`, "now"];
  }

  async function overview() {
    const o = await get("/overview");
    document.getElementById("run").textContent = `run ${o.run_id} · ${o.status} · ${o.groups} groups · policy ${o.policy_version || "–"}`;
    const C = window.Charts;
    const charts = el("div", { class: "charts" });
    if (o.mode === "live") {
      const [xl, xr] = ago(o.samples);
      const span = { xLeft: xl, xRight: xr };
      charts.append(
        C.lineChart("groups_per_s", "Groups finished per second", [{ name: "groups/s", points: rates(o.samples, "groups") }], { ...span, means: "Groups finished per second, between two samples (every 2 s)." }),
        C.lineChart("tokens_per_s", "Completion tokens per second", [{ name: "tokens/s", points: rates(o.samples, "completion_tokens") }], { ...span, means: "Tokens the policy and support models generated per second." }),
        C.lineChart("pools", "Env pools busy", perKey(o.samples, "pools"), { ...span, yMax: 1, legend: true, means: "Per env: the share of its pool's worlds the service holds (1 = every world busy)." }),
        C.lineChart("replicas", "Policy replicas' load", perKey(o.samples, "replicas"), { ...span, legend: true, means: "Per policy replica: chat requests in flight on it." }),
        C.barChart("lag", "Lag of handed-out groups", o.lag.map((b) => ({ label: `≤${b.le}`, value: b.count, title: `${b.count} groups at most ${b.le} updates behind` })), { emptyText: "no sampler stream handed out a group yet", means: "Groups sampler streams handed out, by how many policy updates behind the current version they were." }),
      );
    } else {
      const pts = o.by_group;
      const span = { xLeft: pts.length ? `group ${pts[0].seq}` : "", xRight: pts.length ? `group ${pts[pts.length - 1].seq}` : "" };
      charts.append(
        C.lineChart("mean_reward", "Mean reward per group", [{ name: "mean reward", points: pts.map((p) => [p.seq, p.mean]) }], { ...span, means: "Each group's mean reward, in the order the run log holds them." }),
        C.lineChart("tokens_per_group", "Completion tokens per group", [{ name: "tokens", points: pts.map((p) => [p.seq, p.completion_tokens]) }], { ...span, means: "Completion tokens each group generated." }),
      );
    }
    charts.append(
      C.barChart("signal", "Share of groups with signal, per policy version", o.signal_by_version.map((v) => ({ label: v.version, value: v.groups ? v.signal / v.groups : 0, title: `${v.version}: ${v.signal} of ${v.groups} groups with signal` })), { yMax: 1, means: "Groups whose graded rewards differ (a gradient to learn from), over the groups that ended on that version." }),
      C.barChart("failures", "Failures by kind", o.failures.map((f) => ({ label: f.kind, value: f.count, title: `${f.kind} (${f.attribution}): ${f.count}` })), { emptyText: "no attempt failed", means: "Failed attempts by kind; hover for who is to blame (policy or infrastructure)." }),
    );
    const nodes = [el("h2", { text: o.mode === "live" ? "Overview (live)" : "Overview (run log)" }), charts];
    if (o.replicas.length) {
      const table = el("table", { id: "replicas" }, el("tr", {}, el("th", { text: "replica" }), el("th", { text: "version" }), el("th", { text: "routed" }), el("th", { text: "in flight" })));
      for (const r of o.replicas) table.append(el("tr", {}, el("td", { text: r.url }), el("td", { text: r.version || "–" }), el("td", { text: r.routed ? "yes" : "no" }), el("td", { text: String(r.outstanding) })));
      nodes.push(el("h3", { text: "Policy replicas now" }), table);
    }
    if (o.mode === "runlog") nodes.push(el("p", { class: "note", text: "A run log keeps no clock time: rates, pools, replicas and the lag histogram are shown live only." }));
    show(...nodes);
    if (o.mode === "live") timer = setTimeout(() => route(true), 3000);
  }

  // -- groups -------------------------------------------------------------------------------

  const FILTERS = ["task", "family", "version", "status", "min_reward", "max_reward", "signal"];

  async function groups(params) {
    const offset = Number(params.get("offset") || 0);
    const query = new URLSearchParams();
    for (const f of FILTERS) if (params.get(f)) query.set(f, params.get(f));
    query.set("offset", String(offset));
    query.set("limit", "50");
    const form = el("form", { class: "filters" });
    for (const f of FILTERS) {
      let input;
      if (f === "signal") {
        input = el("select", { name: f }, el("option", { value: "", text: "any" }), el("option", { value: "true", text: "with signal" }), el("option", { value: "false", text: "no signal" }));
      } else {
        input = el("input", { name: f, type: f.endsWith("reward") ? "number" : "text", step: "any" });
      }
      input.value = params.get(f) || "";
      form.append(el("label", {}, f.replace("_", " "), input));
    }
    form.append(el("button", { type: "submit", text: "Filter" }));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const next = new URLSearchParams();
      for (const [k, v] of new FormData(form)) if (v) next.set(k, v);
      location.hash = `#/groups?${next}`;
    });
    const page = await get(`/groups?${query}`);
    const table = el("table", { id: "groups" }, el("tr", {}, ...["#", "task", "family", "version", "n", "rewards", "mean", "pass", "signal", "statuses", "wall s"].map((h) => el("th", { text: h }))));
    for (const g of page.groups) {
      table.append(
        el("tr", {},
          el("td", {}, el("a", { href: `#/group/${g.seq}`, text: String(g.seq) })),
          el("td", { text: g.task_id, title: g.slug }),
          el("td", { text: g.family || "–" }),
          el("td", { text: g.version || "–" }),
          el("td", { text: String(g.n) }),
          el("td", { text: g.rewards.map((r) => (r === null ? "×" : fmt(r))).join(" ") }),
          el("td", { text: fmt(g.mean) }),
          el("td", { text: pct(g.pass_rate) }),
          el("td", { text: g.signal ? "yes" : "no" }),
          el("td", { text: g.statuses.join(", ") }),
          el("td", { text: fmt(g.wall_s) }),
        ),
      );
    }
    const pager = el("div", { class: "pager" });
    const link = (off, text) => {
      const p = new URLSearchParams(params);
      p.set("offset", String(off));
      return el("a", { href: `#/groups?${p}`, text: text });
    };
    if (offset > 0) pager.append(link(Math.max(0, offset - 50), "← newer"));
    pager.append(el("span", { text: `${page.total ? offset + 1 : 0}–${offset + page.groups.length} of ${page.total} matching (${page.held} held)` }));
    if (offset + page.groups.length < page.total) pager.append(link(offset + 50, "older →"));
    show(el("h2", { text: "Groups" }), form, pager, table);
  }

  // -- one group ----------------------------------------------------------------------------

  function lpClass(lp) {
    if (lp === null || lp === undefined) return "masked";
    return `lp${Math.max(0, Math.min(9, Math.floor(Math.exp(lp) * 10)))}`;
  }

  const MAX_TOKENS_SHOWN = 4000;

  function tokenStrip(ids, logprobs, mask) {
    const strip = el("div", { class: "tokens" });
    const shown = Math.min(ids.length, MAX_TOKENS_SHOWN);
    for (let i = 0; i < shown; i++) {
      const sampled = mask ? mask[i] === 1 : true;
      const lp = logprobs ? logprobs[i] : null;
      const tok = el("span", { class: `tok ${sampled ? lpClass(lp) : "masked"}`, text: String(ids[i]) });
      tok.title = sampled ? `token id ${ids[i]} · logprob ${lp === null || lp === undefined ? "none" : lp.toFixed(4)}` : `token id ${ids[i]} · not trainable (prompt or env)`;
      strip.append(tok);
    }
    if (ids.length > shown) strip.append(el("span", { class: "note", text: ` … ${ids.length - shown} more` }));
    return strip;
  }

  function message(m) {
    const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content, null, 2);
    return el("div", { class: "msg" }, el("div", { class: "role", text: String(m.role) }), el("pre", { text: content === undefined ? "" : content }));
  }

  function turnView(turn, previous) {
    const prevLen = previous ? previous.messages.length + 1 : 0;
    const fresh = previous && turn.messages.length > prevLen ? turn.messages.slice(prevLen) : turn.messages;
    const head = el("div", { class: "turnhead" },
      el("span", { class: turn.trainable ? "badge trainable" : "badge", text: turn.trainable ? "trainable" : "not trainable" }),
      `turn ${turn.index} · stage ${turn.stage} · version ${turn.policy_version || "–"}${turn.mixed_version ? ` → ${turn.policy_version_end}` : ""} · ${turn.model} · ${turn.prompt_tokens} prompt + ${turn.completion_tokens} completion tokens · finish ${turn.finish_reason || "–"}`,
    );
    const box = el("div", { class: turn.trainable ? "turn trainable" : "turn" }, head);
    if (previous && fresh !== turn.messages) box.append(el("div", { class: "note", text: `(${prevLen} earlier messages not repeated)` }));
    for (const m of fresh) box.append(message(m));
    box.append(el("div", { class: "role", text: "completion" }), el("pre", { class: "completion", text: turn.completion }));
    if (turn.completion_token_ids) box.append(tokenStrip(turn.completion_token_ids, turn.logprobs, null));
    return box;
  }

  function failureView(f, label) {
    return el("div", { class: "failure" }, el("strong", { text: `${label}: ${f.kind}` }), ` (${f.attribution}) `, el("pre", { text: f.detail || "" }));
  }

  function attemptView(a) {
    const box = el("section", { class: "attempt", id: `attempt-${a.index}` }, el("h3", { text: `Attempt ${a.index} · ${a.status} · reward ${fmt(a.reward)} · advantage ${fmt(a.advantage)}` }));
    if (a.failure) box.append(failureView(a.failure, "failed"));
    for (const f of a.earlier_failures || []) box.append(failureView(f, "earlier try failed"));
    if (a.answer !== null && a.answer !== undefined) box.append(el("div", { class: "role", text: "answer" }), el("pre", { text: typeof a.answer === "string" ? a.answer : JSON.stringify(a.answer, null, 2) }));
    if (a.score) box.append(el("details", { class: "score" }, el("summary", { text: "score (the env's own object)" }), el("pre", { text: JSON.stringify(a.score, null, 2) })));
    a.turns.forEach((t, i) => box.append(turnView(t, i ? a.turns[i - 1] : null)));
    for (const [i, seg] of (a.trajectory || []).entries()) {
      box.append(el("div", { class: "role", text: `exact trajectory segment ${i}: ${seg.token_ids.length} tokens (grey: not trainable; colour: the sampled token's probability)` }), tokenStrip(seg.token_ids, seg.logprobs, seg.loss_mask));
    }
    return box;
  }

  async function group(seq) {
    const g = await get(`/groups/${encodeURIComponent(seq)}`);
    const rows = [
      ["status", (a) => a.status],
      ["reward", (a) => fmt(a.reward)],
      ["advantage", (a) => fmt(a.advantage)],
      ["pass", (a) => (a.pass === null || a.pass === undefined ? "–" : a.pass ? "yes" : "no")],
      ["turns", (a) => String(a.turns.length)],
      ["versions", (a) => (a.oldest_policy_version === a.newest_policy_version ? a.newest_policy_version || "–" : `${a.oldest_policy_version}…${a.newest_policy_version}`)],
      ["tries", (a) => String(a.tries)],
      ["failure", (a) => (a.failure ? `${a.failure.kind} (${a.failure.attribution})` : "–")],
    ];
    const side = el("table", { id: "attempts" }, el("tr", {}, el("th", { text: "attempt" }), ...g.attempts.map((a) => el("th", {}, el("a", { href: `#/group/${seq}/${a.index}`, text: String(a.index) })))));
    for (const [name, value] of rows) side.append(el("tr", {}, el("th", { text: name }), ...g.attempts.map((a) => el("td", { class: a.failure && name === "status" ? "failed" : "", text: value(a) }))));
    const head = el("p", { text: `task ${g.task_id} (${g.slug}) · group ${g.group_id} · versions ${g.oldest_policy_version || "–"}…${g.newest_policy_version || "–"} · mean ${fmt(g.mean)} · std ${fmt(g.std)} · pass ${pct(g.pass_rate)} · ${g.all_equal ? "no signal (all rewards equal)" : "signal"} · ${fmt(g.wall_s)} s` });
    const nodes = [el("h2", { text: `Group ${seq}` }), head];
    if (g.diagnosis) nodes.push(el("p", { class: "note", text: g.diagnosis }));
    nodes.push(el("div", { class: "side" }, side), ...g.attempts.map(attemptView));
    show(...nodes);
  }

  // -- tasks --------------------------------------------------------------------------------

  let taskSort = { key: "task_id", down: false };

  async function tasks() {
    const rows = (await get("/tasks")).map((t) => {
      const latest = t.versions[0] || {};
      return {
        task_id: t.task_id,
        family: t.family || "",
        version: latest.version || "",
        groups: t.versions.reduce((s, v) => s + v.groups, 0),
        mean_reward: latest.mean_reward,
        pass_rate: latest.pass_rate,
        signal_share: latest.signal_share,
        passes: t.versions.slice().reverse().map((v) => v.pass_rate),
      };
    });
    const columns = [["task_id", "task"], ["family", "family"], ["version", "latest version"], ["groups", "groups"], ["mean_reward", "mean reward"], ["pass_rate", "pass rate"], ["signal_share", "signal share"]];
    const cmp = (a, b) => (a === b ? 0 : a === null || a === undefined ? 1 : b === null || b === undefined ? -1 : a < b ? -1 : 1);
    rows.sort((a, b) => cmp(a[taskSort.key], b[taskSort.key]) * (taskSort.down ? -1 : 1));
    const header = el("tr", {});
    for (const [key, name] of columns) {
      const th = el("th", { class: "sortable", text: name + (taskSort.key === key ? (taskSort.down ? " ▼" : " ▲") : "") });
      th.addEventListener("click", () => {
        taskSort = { key: key, down: taskSort.key === key ? !taskSort.down : false };
        route(); // this page again, sorted: its errors handled as any page's
      });
      header.append(th);
    }
    header.append(el("th", { text: "pass rate per version" }));
    const table = el("table", { id: "tasks" }, header);
    for (const r of rows) {
      table.append(el("tr", {},
        el("td", {}, el("a", { href: `#/groups?task=${encodeURIComponent(r.task_id)}`, text: r.task_id })),
        el("td", { text: r.family || "–" }), el("td", { text: r.version || "–" }), el("td", { text: String(r.groups) }),
        el("td", { text: fmt(r.mean_reward) }), el("td", { text: pct(r.pass_rate) }), el("td", { text: pct(r.signal_share) }),
        el("td", {}, window.Charts.sparkline(r.passes)),
      ));
    }
    show(el("h2", { text: "Tasks" }), el("p", { class: "note", text: "GET /tasks/stats: per task, its newest policy version's figures; the line is the pass rate per version, oldest first. Click a column to sort." }), table);
  }

  // -- routing ------------------------------------------------------------------------------

  async function route(refresh) {
    clearTimeout(timer);
    drawing++;
    const hash = location.hash || "#/overview";
    const [path, query] = hash.slice(1).split("?");
    const parts = path.split("/").filter(Boolean);
    for (const a of document.querySelectorAll("header nav a")) a.classList.toggle("active", hash.startsWith(a.getAttribute("href")));
    try {
      if (parts[0] === "groups") await groups(new URLSearchParams(query || ""));
      else if (parts[0] === "group") {
        await group(parts[1]);
        if (parts[2]) document.getElementById(`attempt-${parts[2]}`)?.scrollIntoView();
      } else if (parts[0] === "tasks") await tasks();
      else await overview();
      document.body.dataset.loaded = hash;
    } catch (err) {
      if (err instanceof Stale) return;
      if (err instanceof Unauthorized) askKey("The service wants the trainers' API key (kept in this tab only).");
      else if (!refresh) show(el("p", { class: "error", text: String(err.message || err) }));
    }
  }

  window.addEventListener("hashchange", () => route());
  route();
})();
