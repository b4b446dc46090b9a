// tokenspout playground: an ordinary client of the public /v1 API (no private endpoint).
// Generation streams with `logprobs_mode: processed_logprobs` (the distribution the sampler drew from) and
// `return_token_ids`; a selected position is re-scored with a one-token /v1/completions request on the exact token
// ids before it (`logprobs_mode: raw_logprobs`, top 20): what the model proposed there. The knobs' effect on that
// distribution (temperature, then min-p, top-k, top-p, typical-p, epsilon, eta, XTC: the sampler's order) is
// computed here, over those 20, so the chart follows a slider without a request.
"use strict";

const $ = (id) => document.getElementById(id);
const KNOBS = ["temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
  "repetition_penalty", "typical_p", "epsilon_cutoff", "eta_cutoff", "xtc_probability", "xtc_threshold",
  "top_n_sigma", "dynatemp_range", "dynatemp_exponent", "no_repeat_ngram_size", "dry_multiplier", "dry_base",
  "dry_allowed_length", "mirostat_tau", "mirostat_eta"];
const RAW_TOP = 20;
const state = {
  model: null,
  tokens: [],      // {text, id, p (processed prob or null), top: [{token, p}], run, offset}
  selected: -1,
  controller: null,
  rescored: new Map(),  // key: context ids joined -> [{token, lp}] (raw, best first)
};

// ------------------------------------------------------------------------------------------------ requests

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;  // else the browser's own (HTTP Basic) credentials, if any
  return h;
}

async function api(path, body, signal) {
  // location.origin, not a relative path: a page opened as http://user:key@host/ would hand its credentials to a
  // relative URL, which fetch refuses; the browser still sends its cached Basic credentials to the origin.
  const r = await fetch(location.origin + path, {
    method: body ? "POST" : "GET", headers: headers(), signal,
    body: body ? JSON.stringify(body) : undefined,
  });
  if (!r.ok) {
    let msg = r.statusText;
    try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(`${r.status}: ${msg}`);
  }
  return r;
}

async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function parseJsonField(id, what) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try { return JSON.parse(text); } catch (e) { throw new Error(`${what} is not valid JSON: ${e.message}`); }
}

function samplingBody() {
  const b = { model: state.model, stream: true, return_token_ids: true, logprobs_mode: "processed_logprobs",
    max_tokens: parseInt($("max_tokens").value, 10) || 16 };
  for (const k of KNOBS) b[k] = Number($(k).value);
  b.mirostat = Number($("mirostat").value);
  const effort = $("reasoning_effort").value;
  if (effort && mode() === "chat") b.reasoning_effort = effort;
  const seed = $("seed").value.trim();
  if (seed !== "") b.seed = parseInt(seed, 10);
  const stops = $("stop-strings").value.split("\n").filter((s) => s.length);
  if (stops.length) b.stop = stops;
  const bias = parseJsonField("logit_bias", "logit bias");
  if (bias !== undefined) b.logit_bias = bias;
  const schema = parseJsonField("json_schema", "JSON schema");
  const regex = $("regex").value;
  if (schema !== undefined) b.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
  else if (regex) b.structured_outputs = { regex };
  return b;
}

function mode() { return document.querySelector("input[name=mode]:checked").value; }

function requestFor(prefix) {
  const b = samplingBody();
  if (mode() === "chat") {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: $("prompt").value });
    if (prefix) {  // regenerate from here: the kept text is an assistant message the reply continues
      messages.push({ role: "assistant", content: prefix });
      b.continue_final_message = true;
      b.add_generation_prompt = false;
    }
    return ["/v1/chat/completions", { ...b, messages, logprobs: true, top_logprobs: 5 }];
  }
  return ["/v1/completions", { ...b, prompt: $("prompt").value + prefix, logprobs: 5 }];
}

// One streamed chunk -> the new tokens of its first choice ({text, id, p, top}); completions and chat differ.
function tokensOf(chunk, run) {
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return [];
  if (chunk.prompt_token_ids) run.promptIds = chunk.prompt_token_ids;
  if (choice.prompt_token_ids) run.promptIds = choice.prompt_token_ids;
  const ids = choice.token_ids || [];
  const out = [];
  if (choice.logprobs && choice.logprobs.content) {  // chat
    choice.logprobs.content.forEach((lp, i) => out.push({
      text: lp.token, id: ids[i], p: Math.exp(lp.logprob),
      top: (lp.top_logprobs || []).map((t) => ({ token: t.token, p: Math.exp(t.logprob) })),
    }));
  } else if (choice.logprobs && choice.logprobs.tokens) {  // completions
    const lps = choice.logprobs;
    lps.tokens.forEach((t, i) => out.push({
      text: t, id: ids[i], p: Math.exp(lps.token_logprobs[i]),
      top: Object.entries(lps.top_logprobs[i] || {}).map(([token, lp]) => ({ token, p: Math.exp(lp) }))
        .sort((a, b) => b.p - a.p),
    }));
  } else {
    const text = (choice.delta && choice.delta.content) || choice.text || "";
    if (text) out.push({ text, id: ids[0], p: null, top: [] });
  }
  return out;
}

async function generate(keep) {
  if (state.controller) state.controller.abort();
  setError("");
  let path, body;
  const prefix = state.tokens.slice(0, keep).map((t) => t.text).join("");
  try { [path, body] = requestFor(prefix); } catch (e) { setError(e.message); return; }
  state.tokens = state.tokens.slice(0, keep);
  select(-1);
  render();
  const controller = new AbortController();
  state.controller = controller;
  $("stop").disabled = false;
  setStatus("generating", "generating…");
  const run = { promptIds: null, ids: [] };
  let finish = null;
  try {
    const resp = await api(path, body, controller.signal);
    for await (const chunk of sseEvents(resp)) {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const t of tokensOf(chunk, run)) {
        t.run = run;
        t.offset = run.ids.length;
        run.ids.push(t.id);
        state.tokens.push(t);
        appendToken(state.tokens.length - 1);
      }
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.finish_reason) finish = choice.finish_reason;
    }
    setStatus("done", `${state.tokens.length - keep} tokens, finish_reason: ${finish}`);
  } catch (e) {
    if (e.name === "AbortError") setStatus("done", "stopped");
    else { setError(e.message); setStatus("error", "error"); }
  } finally {
    if (state.controller === controller) state.controller = null;
    $("stop").disabled = true;
  }
}

// The model's distribution at token i's position: a one-token completion on the exact ids before it.
async function rescore(i) {
  const t = state.tokens[i];
  if (!t.run || !t.run.promptIds || t.run.ids.slice(0, t.offset).some((x) => x === undefined)) return null;
  const ids = t.run.promptIds.concat(t.run.ids.slice(0, t.offset));
  const key = ids.join(",");
  if (!state.rescored.has(key)) {
    const r = await api("/v1/completions", { model: state.model, prompt: ids, max_tokens: 1, logprobs: RAW_TOP,
      temperature: 1.0, logprobs_mode: "raw_logprobs" });
    const lps = (await r.json()).choices[0].logprobs;
    const top = Object.entries(lps.top_logprobs[0] || {}).map(([token, lp]) => ({ token, lp }))
      .sort((a, b) => b.lp - a.lp);
    state.rescored.set(key, top);
  }
  return state.rescored.get(key);
}

// ------------------------------------------------------------------------------------------------ the knobs

// `items`: raw logprobs, best first.  Returns [{token, raw, kept, cut}] with the sampler's order: temperature
// (0 = greedy), then min-p, top-k, top-p, renormalised over these items.
function applyKnobs(items) {
  const T = Number($("temperature").value), k = Number($("top_k").value);
  const topP = Number($("top_p").value), minP = Number($("min_p").value);
  const raw = items.map((it) => Math.exp(it.lp));
  let w;
  if (T === 0) w = items.map((_, i) => (i === 0 ? 1 : 0));
  else w = items.map((it) => Math.exp((it.lp - items[0].lp) / T));
  const z = w.reduce((a, b) => a + b, 0);
  const q = w.map((x) => x / z);
  const cut = items.map((_, i) => (T === 0 && i > 0 ? "greedy" : null));
  if (minP > 0) q.forEach((x, i) => { if (!cut[i] && x < minP * q[0]) cut[i] = "min-p"; });
  if (k > 0) items.forEach((_, i) => { if (!cut[i] && i >= k) cut[i] = "top-k"; });
  if (topP < 1) {
    const keptMass = q.reduce((a, x, i) => a + (cut[i] ? 0 : x), 0);
    let cum = 0;
    q.forEach((x, i) => {
      if (cut[i]) return;
      if (cum >= topP * keptMass) cut[i] = "top-p";
      else cum += x;
    });
  }
  warpers(q, cut);
  const zKept = q.reduce((a, x, i) => a + (cut[i] ? 0 : x), 0) || 1;
  return items.map((it, i) => ({ token: it.token, raw: raw[i], kept: cut[i] ? 0 : q[i] / zKept, cut: cut[i] }));
}

// The survivors' probabilities, renormalised, and their entropy.
function survivors(q, cut) {
  const z = q.reduce((a, x, i) => a + (cut[i] ? 0 : x), 0) || 1;
  const p = q.map((x, i) => (cut[i] ? 0 : x / z));
  const h = -p.reduce((a, x) => a + (x > 0 ? x * Math.log(x) : 0), 0);
  return [p, h];
}

// typical-p, epsilon, eta (transformers' warpers) and XTC (llama.cpp, as if its coin came up), in the sampler's
// order, each on what the steps before it left; marks cut[i].
function warpers(q, cut) {
  const typ = Number($("typical_p").value), eps = Number($("epsilon_cutoff").value);
  const eta = Number($("eta_cutoff").value), xtcP = Number($("xtc_probability").value);
  const xtcT = Number($("xtc_threshold").value);
  const topKept = () => cut.findIndex((c) => !c);  // items are best first
  if (typ < 1) {
    const [p, h] = survivors(q, cut);
    const order = p.map((x, i) => [Math.abs(-Math.log(x) - h), i]).filter(([, i]) => !cut[i])
      .sort((a, b) => a[0] - b[0]);
    let cum = 0, vstar = order.length ? order[order.length - 1][0] : 0;
    for (const [s, i] of order) { cum += p[i]; if (cum >= typ) { vstar = s; break; } }
    for (const [s, i] of order) if (s > vstar) cut[i] = "typical";
  }
  for (const [name, e] of [["epsilon", eps], ["eta", eta]]) {
    if (!(e > 0)) continue;
    const [p, h] = survivors(q, cut);
    const bound = name === "eta" ? Math.min(e, Math.sqrt(e) * Math.exp(-h)) : e;
    const top = topKept();
    p.forEach((x, i) => { if (!cut[i] && i !== top && x < bound) cut[i] = name; });
  }
  if (xtcP > 0 && xtcT <= 0.5) {
    const [p] = survivors(q, cut);
    const above = p.map((x, i) => i).filter((i) => !cut[i] && p[i] >= xtcT);
    if (above.length >= 2) {
      const least = Math.min(...above.map((i) => p[i]));
      for (const i of above) if (p[i] > least) cut[i] = `xtc (${Math.round(100 * xtcP)}% of steps)`;
    }
  }
}

// ------------------------------------------------------------------------------------------------ rendering

const pct = (p) => (p === null || p === undefined ? "–" : (100 * p).toFixed(p < 0.001 ? 3 : 1) + "%");
const visible = (s) => s.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/ /g, "\u00a0");

function tokenSpan(i) {
  const t = state.tokens[i];
  const span = document.createElement("span");
  span.className = "tok";
  span.dataset.index = String(i);
  span.tabIndex = 0;
  const label = document.createElement("span");
  label.className = "t";
  label.textContent = t.text.replace(/\n/g, "↵");
  span.appendChild(label);
  const num = document.createElement("span");
  num.className = "p";
  if (t.p !== null && t.p !== undefined) {
    span.dataset.p = t.p.toFixed(6);
    // Shaded by probability (red: unlikely, green: likely) and always written as a number too.
    span.style.background = `hsl(${Math.round(120 * t.p)}, 70%, 86%)`;
    if (t.p < 0.1) span.style.borderBottom = "2px dashed #a40e26";
    num.textContent = pct(t.p);
  }
  span.appendChild(num);
  span.setAttribute("aria-label", `${JSON.stringify(t.text)} probability ${pct(t.p)}`);
  span.addEventListener("mouseenter", () => select(i));
  span.addEventListener("click", () => select(i));
  span.addEventListener("focus", () => select(i));
  return span;
}

function appendToken(i) {
  const out = $("output");
  out.appendChild(tokenSpan(i));
  if (state.tokens[i].text.includes("\n")) out.appendChild(document.createElement("br"));
}

function render() {
  $("output").replaceChildren();
  state.tokens.forEach((_, i) => appendToken(i));
}

async function select(i) {
  state.selected = i;
  document.querySelectorAll(".tok.selected").forEach((el) => el.classList.remove("selected"));
  $("regen-here").disabled = i < 0;
  if (i < 0) {
    $("pos-label").textContent = "(hover or tap a token)";
    $("details").replaceChildren();
    $("chart").replaceChildren();
    return;
  }
  const el = document.querySelector(`.tok[data-index="${i}"]`);
  if (el) el.classList.add("selected");
  const t = state.tokens[i];
  $("pos-label").textContent = `${i}: ${JSON.stringify(t.text)} (${pct(t.p)})`;
  renderDetails(t, null);
  try {
    const raw = await rescore(i);
    if (state.selected === i) { renderDetails(t, raw); renderChart(raw); }
  } catch (e) { setError(e.message); }
}

function renderDetails(t, raw) {
  // The alternatives as the sampler saw them (processed, from the stream) beside the model's (raw, re-scored).
  const rows = new Map();
  for (const a of t.top) rows.set(a.token, { token: a.token, processed: a.p, raw: null });
  for (const a of raw || []) {
    const row = rows.get(a.token) || { token: a.token, processed: null, raw: null };
    row.raw = Math.exp(a.lp);
    rows.set(a.token, row);
  }
  const table = document.createElement("table");
  table.innerHTML = "<thead><tr><th>alternative</th><th>model (raw)</th><th>sampler (processed)</th></tr></thead>";
  const body = document.createElement("tbody");
  [...rows.values()].sort((a, b) => (b.processed ?? -1) - (a.processed ?? -1) || (b.raw ?? 0) - (a.raw ?? 0))
    .slice(0, 10).forEach((r) => {
      const tr = document.createElement("tr");
      tr.className = "alt";
      if (r.token === t.text) tr.style.fontWeight = "bold";
      for (const [cls, text] of [["", visible(r.token)], ["num", raw ? pct(r.raw) : "…"], ["num", pct(r.processed)]]) {
        const td = document.createElement("td");
        td.className = cls;
        td.textContent = text;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    });
  table.appendChild(body);
  $("details").replaceChildren(table);
}

function renderChart(raw) {
  const chart = $("chart");
  chart.replaceChildren();
  if (!raw) return;
  for (const row of applyKnobs(raw)) {
    const div = document.createElement("div");
    div.className = "bar-row" + (row.cut ? " cut" : "");
    div.setAttribute("role", "row");
    div.dataset.kept = row.kept.toFixed(6);
    div.dataset.raw = row.raw.toFixed(6);
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = visible(row.token);
    const track = document.createElement("span");
    track.className = "track";
    const rawBar = document.createElement("span");
    rawBar.className = "raw";
    rawBar.style.width = (100 * row.raw).toFixed(2) + "%";
    const keptBar = document.createElement("span");
    keptBar.className = "kept";
    keptBar.style.width = (100 * row.kept).toFixed(2) + "%";
    track.append(rawBar, keptBar);
    const num = document.createElement("span");
    num.className = "num";
    num.textContent = `${pct(row.raw)} → ${row.cut ? "cut: " + row.cut : pct(row.kept)}`;
    div.append(label, track, num);
    chart.appendChild(div);
  }
}

function setStatus(kind, text) { $("status").dataset.state = kind; $("status").textContent = text; }
function setError(text) { $("error").textContent = text; }

function showKnob(k) { $(k + "-v").textContent = $(k).value; }

// ------------------------------------------------------------------------------------------------ wiring

window.addEventListener("DOMContentLoaded", async () => {
  for (const k of KNOBS) {
    showKnob(k);
    $(k).addEventListener("input", () => {
      showKnob(k);
      const i = state.selected;
      if (i >= 0) {  // re-draw the selected position under the new knobs: no request
        const t = state.tokens[i];
        if (t.run && t.run.promptIds) {
          const key = t.run.promptIds.concat(t.run.ids.slice(0, t.offset)).join(",");
          if (state.rescored.has(key)) renderChart(state.rescored.get(key));
        }
      }
    });
  }
  $("show-numbers").addEventListener("change", (e) => $("output").classList.toggle("hide-numbers", !e.target.checked));
  $("generate").addEventListener("click", () => generate(0));
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("regen-here").addEventListener("click", () => { if (state.selected >= 0) generate(state.selected); });
  document.querySelectorAll("input[name=mode]").forEach((r) => r.addEventListener("change", () => {
    $("system").style.display = mode() === "chat" ? "" : "none";
  }));
  try {
    const r = await api("/v1/models");
    state.model = (await r.json()).data[0].id;
    $("model").textContent = state.model;
    setStatus("ready", "ready");
  } catch (e) { setError(`could not list models: ${e.message}`); }
});
