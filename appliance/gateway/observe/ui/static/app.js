// The status page: polls admin/history with the pasted key (a Bearer header, never a URL
// or cookie) and draws it. Hand-written, no framework, no build step. Every name and
// message goes into the page as text (textContent / text nodes), never as HTML: a key or
// model named "<img src=x onerror=alert(1)>" shows as those characters. Nothing here is
// inline (the page's CSP allows this file only), and no window.confirm/alert: the
// confirmation is part of the page. URLs are relative, so it works behind TLS or a proxy.
"use strict";
(() => {
  const KEY = "llm-appliance.key";
  const POLL_MS = 1000; // a change shows within ~1 s (the contract asks for 2 s)
  const HOUR_S = 3600;
  const MAX_SAMPLES = 1800;
  const MAX_EVENTS = 200;
  const SVG = "http://www.w3.org/2000/svg";
  const $ = (id) => document.getElementById(id);

  let seq = 0, samples = [], events = [], timer = null, doc = null, pending = null;

  function el(tag, attrs, ...kids) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") n.className = v;
      else if (k === "on") for (const [ev, fn] of Object.entries(v)) n.addEventListener(ev, fn);
      else n.setAttribute(k, v);
    }
    for (const kid of kids) if (kid !== null && kid !== undefined) n.append(kid); // strings: text
    return n;
  }
  function svg(tag, attrs) {
    const n = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, String(v));
    return n;
  }
  const fmt = (v, digits, unit) => (v === null || v === undefined ? "–" : Number(v).toFixed(digits) + (unit || ""));
  const clock = (t) => new Date(t * 1000).toLocaleTimeString();

  // ---- signing in and polling --------------------------------------------------------
  function showSignIn(message) {
    clearTimeout(timer);
    $("dash").hidden = true; $("signout").hidden = true; $("signin").hidden = false;
    $("who").textContent = "";
    $("signin-message").textContent = message;
  }
  function refusal(status, message) {
    if (status === 403) {
      return "This key cannot see this page: it does not have the metrics or admin scope " +
        "(a user key can call the API only). Sign in with a metrics or admin key.";
    }
    return "This key was not accepted (" + message + "). Check it and sign in again.";
  }
  async function errorMessage(resp) {
    try { const b = await resp.json(); return (b && b.error && b.error.message) || resp.statusText; }
    catch (e) { return resp.statusText || String(resp.status); }
  }
  function start() {
    seq = 0; samples = []; events = [];
    $("signin").hidden = true; $("dash").hidden = false; $("signout").hidden = false;
    poll();
  }
  function schedule() { clearTimeout(timer); timer = setTimeout(poll, POLL_MS); }
  function authed(init) {
    const key = sessionStorage.getItem(KEY);
    return Object.assign({ cache: "no-store", credentials: "omit",
      headers: { Authorization: "Bearer " + key } }, init || {});
  }

  async function poll() {
    if (!sessionStorage.getItem(KEY)) return showSignIn("");
    let resp;
    try { resp = await fetch("admin/history?after=" + seq, authed()); }
    catch (e) { $("updated").textContent = "Cannot reach the appliance; retrying."; return schedule(); }
    if (resp.status === 401 || resp.status === 403) {
      sessionStorage.removeItem(KEY);
      return showSignIn(refusal(resp.status, await errorMessage(resp)));
    }
    if (!resp.ok) {
      $("updated").textContent = "The appliance answered " + resp.status + ": " + (await errorMessage(resp));
      return schedule();
    }
    const d = await resp.json();
    if (d.seq < seq) { seq = 0; samples = []; events = []; return poll(); } // the daemon restarted
    seq = d.seq;
    samples = samples.concat(d.samples).slice(-MAX_SAMPLES);
    events = events.concat(d.events).slice(-MAX_EVENTS);
    doc = d;
    render();
    schedule();
  }

  // ---- drawing -------------------------------------------------------------------------
  function render() {
    const st = doc.status;
    $("who").textContent = doc.scope === "admin" ? "signed in: admin" : "signed in: metrics (read-only)";
    $("updated").textContent = "Updated " + clock(doc.now) + " · " + st.engines.length + " engine(s), " +
      (st.ready ? "ready" : "NOT ready") + (st.accepting ? "" : " · shutting down") +
      " · version " + st.version;
    $("models").replaceChildren(...models(st));
    $("gpus").replaceChildren(...st.gpus.map(gpuCard));
    $("traffic").replaceChildren(...traffic(st));
    $("usage-section").hidden = doc.usage === null;
    if (doc.usage !== null) $("usage").replaceChildren(usageTable(doc.usage));
    $("events").replaceChildren(...events.slice().reverse().map((e) =>
      el("li", { class: "ev-" + e.kind }, el("time", {}, clock(e.t)), " ", el("b", {}, e.kind), " ", e.text)));
  }

  function models(st) {
    const by = new Map();
    for (const e of st.engines) { if (!by.has(e.model)) by.set(e.model, []); by.get(e.model).push(e); }
    const out = [];
    for (const [name, engines] of by) {
      const head = ["Engine", "State", "GPU", "In flight", "KV cache", "Restarts (last reason)",
        "Last exit", "Spec. acceptance"];
      if (doc.scope === "admin") head.push("Actions");
      const rows = engines.map((e) => engineRow(e, st.engines));
      out.push(el("h3", {}, "Model ", el("span", { class: "model" }, name)),
        el("div", { class: "scroll" }, el("table", {}, el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))),
          el("tbody", {}, ...rows))));
    }
    return out;
  }

  function engineRow(e, all) {
    const kv = e.kv_cache_usage === null ? "–" : el("span", {}, el("meter", { min: 0, max: 1, value: e.kv_cache_usage }),
      " " + fmt(e.kv_cache_usage * 100, 0, " %"));
    const spec = e.spec_acceptance_rate === null ? "–" :
      fmt(e.spec_acceptance_rate * 100, 0, " %") + " (" + fmt(e.spec_mean_accepted_length, 2) + " tok/step)";
    const cells = [String(e.id), el("span", { class: "state st-" + e.state }, e.state),
      e.gpus.length ? e.gpus.join(", ") : "CPU", String(e.inflight), kv,
      e.restarts + (e.last_restart_reason ? " (" + e.last_restart_reason + ")" : ""),
      e.last_exit || "–", spec];
    if (doc.scope === "admin") cells.push(actions(e, all));
    return el("tr", { "data-engine": String(e.id), "data-model": e.model }, ...cells.map((c) => el("td", {}, c)));
  }

  function actions(e, all) {
    const box = el("span", { class: "actions" });
    const add = (action, label) => box.append(el("button", { type: "button", "data-action": action,
      on: { click: () => ask(action, e, all) } }, label));
    if (e.state === "DRAINING") add("resume", "Resume"); else add("drain", "Drain");
    add("restart", "Restart");
    return box;
  }

  // ---- actions: a confirmation that says what will happen, then a POST with the key ----
  function ask(action, e, all) {
    const last = !all.some((o) => o.id !== e.id && o.state === "READY");
    let text, label = action[0].toUpperCase() + action.slice(1), force = false;
    if (action === "drain" && last) {
      force = true; label = "Drain anyway (force)";
      text = "Engine " + e.id + " is the last engine serving: draining it stops the service " +
        "(no engine takes new requests) until you resume it. Its running requests finish.";
    } else if (action === "drain") {
      text = "Drain engine " + e.id + " (" + e.model + ")? It takes no new requests until you " +
        "resume it; the requests it is running finish. Its model is served by the others.";
    } else if (action === "resume") {
      text = "Resume engine " + e.id + " (" + e.model + ")? It takes new requests again.";
    } else {
      text = "Restart engine " + e.id + " (" + e.model + ")? It is drained first (its running " +
        "requests finish, up to the drain timeout), then its process is restarted; it serves " +
        "again once it is ready." + (last ? " It is the last engine serving: the restart waits for another." : "");
    }
    pending = { action, id: e.id, force };
    $("confirm-text").textContent = text;
    $("confirm-yes").textContent = label;
    $("confirm").hidden = false;
    $("confirm-yes").focus();
  }

  async function act() {
    const p = pending; pending = null; $("confirm").hidden = true;
    if (!p) return;
    const url = "admin/engines/" + p.id + "/" + p.action + (p.force ? "?force=true" : "");
    let message;
    try {
      const resp = await fetch(url, authed({ method: "POST" }));
      const body = await resp.json().catch(() => null);
      message = resp.ok
        ? "Engine " + p.id + ": " + p.action + " " + (resp.status === 202 ? "asked for" : "done") +
          (body && body.state ? ", now " + body.state : "") + "."
        : "Engine " + p.id + ": " + p.action + " refused: " + ((body && body.error && body.error.message) || resp.status);
    } catch (err) { message = "Engine " + p.id + ": " + p.action + " not sent: the appliance cannot be reached."; }
    $("action-message").textContent = message;
    poll();
  }

  // ---- GPUs and charts ----------------------------------------------------------------
  function throttleReason(g) {
    const lim = doc.limits, t = g.temperature_c;
    if (g.throttle_level === 0) return "not throttled";
    const why = [];
    if (t !== null && t >= lim.hard_c) why.push("at or above the hard limit: admits nothing new");
    else if (t !== null && t >= lim.soft_c) why.push("above the soft limit");
    if (g.throttle_reasons.length) why.push("clock events: " + g.throttle_reasons.join(", "));
    if (!why.length) why.push("cooling: held until below the limit minus the hysteresis");
    return why.join("; ");
  }

  function series(pick) {
    return samples.map((s) => [s.t, pick(s)]).filter((p) => p[1] !== null && p[1] !== undefined);
  }

  function chart(title, points, opts) {
    // The last hour, or since the daemon started when that is less (at least 2 min).
    const W = 300, H = 64, now = doc.now;
    const span = Math.max(120, Math.min(HOUR_S, now - (samples.length ? samples[0].t : now)));
    const vals = points.map((p) => p[1]).concat(opts.lines || []);
    let lo = Math.min(opts.min === undefined ? Infinity : opts.min, ...vals);
    let hi = Math.max(opts.max === undefined ? -Infinity : opts.max, ...vals);
    if (!isFinite(lo) || !isFinite(hi)) { lo = 0; hi = 1; }
    if (hi === lo) hi = lo + 1;
    const x = (t) => ((t - (now - span)) / span) * W;
    const y = (v) => H - 2 - ((v - lo) / (hi - lo)) * (H - 4);
    const s = svg("svg", { viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", class: "chart", role: "img" });
    const label = svg("title", {}); label.textContent = title; s.append(label);
    for (const v of opts.lines || []) s.append(svg("line", { x1: 0, x2: W, y1: y(v), y2: y(v), class: "limit" }));
    s.append(svg("polyline", { points: points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" "), class: "line" }));
    const last = points.length ? points[points.length - 1][1] : null;
    const caption = title + ": " + fmt(last, opts.digits || 0, opts.unit) + " (last " + Math.round(span / 60) + " min)";
    return el("figure", {}, s, el("figcaption", {}, caption));
  }

  function gpuCard(g) {
    const at = (i) => series((s) => { const r = s.gpus.find((x) => x[0] === g.index); return r ? r[i] : null; });
    const lim = doc.limits;
    const row = (k, v, cls) => [el("dt", {}, k), el("dd", cls ? { class: cls } : {}, v)];
    return el("div", { class: "card lvl-" + g.throttle_level, "data-gpu": String(g.index) },
      el("h3", {}, "GPU " + g.index + (g.name ? " · " + g.name : "")),
      el("dl", {},
        ...row("Temperature", fmt(g.temperature_c, 0, " °C")),
        ...row("Throttle", "level " + g.throttle_level + " of 4", "throttle"),
        ...row("Why", throttleReason(g), "throttle-reason"),
        ...row("Limits", "soft " + fmt(lim.soft_c, 0) + " °C, hard " + fmt(lim.hard_c, 0) + " °C"),
        ...row("Power", fmt(g.power_w, 0, " W") + " of " + fmt(g.power_limit_w, 0, " W")),
        ...row("SM clock", fmt(g.sm_clock_mhz, 0, " MHz")),
        ...row("Memory", g.memory_total_bytes ? fmt(g.memory_used_bytes / 2 ** 30, 1) + " of " + fmt(g.memory_total_bytes / 2 ** 30, 1) + " GiB" : "–")),
      chart("Temperature", at(1), { lines: [lim.soft_c, lim.hard_c], unit: " °C" }),
      chart("Throttle level", at(4), { min: 0, max: 4 }),
      chart("Power", at(2), { min: 0, unit: " W" }),
      chart("SM clock", at(3), { min: 0, unit: " MHz" }));
  }

  function traffic(st) {
    const ttft = series((s) => s.ttft_s);
    const recent = samples.filter((s) => s.t > doc.now - 300).reduce((n, s) => n + s.rejected, 0);
    const last = samples.length ? samples[samples.length - 1] : { queue: [0, 0] };
    return [el("div", { class: "card" },
      el("dl", {},
        el("dt", {}, "Waiting now"), el("dd", { class: "queue" }, "interactive " + last.queue[0] + ", batch " + last.queue[1]),
        el("dt", {}, "Rejected (5 min)"), el("dd", {}, String(recent)),
        el("dt", {}, "TTFT"), el("dd", {}, fmt(ttft.length ? ttft[ttft.length - 1][1] * 1000 : null, 0, " ms")),
        el("dt", {}, "Tokens/s"), el("dd", {}, fmt(last.tokens_per_s, 1))),
      chart("Queue (interactive + batch)", series((s) => s.queue[0] + s.queue[1]), { min: 0 }),
      chart("Rejections per sample", series((s) => s.rejected), { min: 0 })),
    el("div", { class: "card" },
      chart("Time to first token", ttft.map((p) => [p[0], p[1] * 1000]), { min: 0, unit: " ms" }),
      chart("Tokens per second", series((s) => s.tokens_per_s), { min: 0, digits: 1 }))];
  }

  function usageTable(rows) {
    if (!rows.length) return el("p", {}, "No tokens used in the last 24 h.");
    return el("div", { class: "scroll" }, el("table", {},
      el("thead", {}, el("tr", {}, ...["Key", "Id", "Prompt tokens", "Completion tokens"].map((h) => el("th", {}, h)))),
      el("tbody", {}, ...rows.map((r) => el("tr", { "data-key": r.id },
        el("td", { class: "key-name" }, r.name === null ? "(revoked)" : r.name), el("td", {}, r.id),
        el("td", {}, String(r.prompt_tokens)), el("td", {}, String(r.completion_tokens)))))));
  }

  // ---- wiring ----------------------------------------------------------------------------
  $("signin-form").addEventListener("submit", (ev) => {
    ev.preventDefault(); // the key never goes into a URL or a form post
    const key = $("key").value.trim();
    $("key").value = "";
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    start();
  });
  $("signout").addEventListener("click", () => { sessionStorage.removeItem(KEY); showSignIn("Signed out."); });
  $("confirm-yes").addEventListener("click", act);
  $("confirm-no").addEventListener("click", () => { pending = null; $("confirm").hidden = true; });
  if (sessionStorage.getItem(KEY)) start(); else showSignIn("");
})();
