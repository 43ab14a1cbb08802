"use strict";
// The chat page: one conversation, kept in the browser's localStorage, with replies
// streamed from /v1/chat/completions. Each streamed chunk says how many of its tokens were
// accepted draft tokens and which speculator type proposed them (the server's
// `speculative` extension); that text is shaded by type. With "compare" on, the same
// request runs again with speculation off, and both speeds and texts are set side by side.

(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = "specserve.chat";
  const KEY_STORE = "specserve.apiKey";
  const DEFAULTS = { system: "", temperature: 0, maxTokens: 512, compare: false, shade: true };

  const state = load();
  let running = null; // the AbortController of the request in flight
  let live = null; // the reply being streamed (it shows a caret)
  let frame = 0; // a pending animation frame's id: one repaint per frame at most

  function load() {
    let saved = null;
    try {
      saved = JSON.parse(localStorage.getItem(STORE));
    } catch (e) {
      saved = null;
    }
    const messages = saved && Array.isArray(saved.messages) ? saved.messages : [];
    return { messages, settings: { ...DEFAULTS, ...((saved && saved.settings) || {}) } };
  }

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(state));
    } catch (e) {
      // storage full or disabled: the conversation lives on in the page
    }
  }

  const apiKey = () => localStorage.getItem(KEY_STORE) || "";

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
    return h;
  }

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function failure(res) {
    let message = `${res.status} ${res.statusText}`;
    try {
      message = (await res.json()).error.message || message;
    } catch (e) {
      // not an OpenAI error body: the status says enough
    }
    return new HttpError(res.status, message);
  }

  // -- the model and the API key ---------------------------------------------------------
  async function connect() {
    const res = await fetch("/v1/models", { headers: headers() });
    if (res.status === 401) {
      askKey((await failure(res)).message);
      return;
    }
    $("keyform").hidden = true;
    if (res.ok) {
      const models = (await res.json()).data || [];
      $("model").textContent = models.length ? models[0].id : "";
    }
  }

  function askKey(why) {
    $("keyform").hidden = false;
    $("key-why").textContent = why;
    $("key").focus();
  }

  // -- a reply: its text, where each piece came from, and its statistics ------------------
  const newReply = () => ({
    role: "assistant",
    content: "",
    segments: [], // [text, speculator type or ""]
    stats: { tokens: 0, drafted: 0, runs: 0, t0: 0, t1: 0, timings: null },
  });

  function push(segments, text, by) {
    if (!text) return;
    const last = segments[segments.length - 1];
    if (last && last[1] === by) last[0] += text;
    else segments.push([text, by]);
  }

  function take(reply, text, spec) {
    const s = reply.stats;
    const now = performance.now();
    if (!s.t0) s.t0 = now;
    s.t1 = now;
    reply.content += text;
    if (!spec) {
      push(reply.segments, text, "");
      return;
    }
    s.tokens += spec.tokens;
    s.drafted += spec.drafted;
    s.runs += spec.drafted > 0 ? 1 : 0;
    const by = spec.type || "";
    if (!spec.drafted) push(reply.segments, text, "");
    else if (spec.drafted >= spec.tokens) push(reply.segments, text, by);
    else {
      // a chunk of drafted and own tokens (text held back across steps): shared by count
      const cut = Math.round((text.length * spec.drafted) / spec.tokens);
      push(reply.segments, text.slice(0, cut), by);
      push(reply.segments, text.slice(cut), "");
    }
  }

  // tokens per second: the server's decode speed once it is known, else measured here
  function speed(stats) {
    if (stats.timings && stats.timings.predicted_per_second) {
      return stats.timings.predicted_per_second;
    }
    const seconds = (stats.t1 - stats.t0) / 1000;
    return seconds > 0 && stats.tokens > 1 ? (stats.tokens - 1) / seconds : 0;
  }

  function summary(stats) {
    const parts = [`${speed(stats).toFixed(1)} tok/s`, `${stats.tokens} tokens`];
    const t = stats.timings;
    if (stats.drafted || (t && t.draft_n)) {
      const share = stats.tokens ? Math.round((100 * stats.drafted) / stats.tokens) : 0;
      parts.push(`${stats.drafted} from drafts (${share} %)`);
      if (t) parts.push(`drafted ${t.draft_n} / accepted ${t.draft_n_accepted}`);
      if (stats.runs) parts.push(`mean accepted run ${(stats.drafted / stats.runs).toFixed(1)}`);
    }
    return parts.join(" · ");
  }

  // -- streaming -------------------------------------------------------------------------
  async function stream(body, onChunk, signal) {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal,
    });
    if (!res.ok) throw await failure(res);
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    const end = { timings: null, finish: null };
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return end;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return end;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.timings) end.timings = chunk.timings;
          const choice = (chunk.choices || [])[0];
          if (!choice) continue;
          if (choice.finish_reason) end.finish = choice.finish_reason;
          const text = (choice.delta && choice.delta.content) || "";
          if (text || chunk.speculative) onChunk(text, chunk.speculative);
        }
      }
    }
  }

  function request(seed) {
    const s = state.settings;
    const turns = state.messages
      .filter((m) => m.role === "user" || (m.content && !m.error))
      .map((m) => ({ role: m.role, content: m.content }));
    if (s.system.trim()) turns.unshift({ role: "system", content: s.system });
    const body = { messages: turns, stream: true, max_tokens: Number(s.maxTokens) || 512, seed };
    body.temperature = Number(s.temperature) || 0;
    return body;
  }

  async function runInto(reply, body, signal) {
    live = reply;
    const end = await stream(body, (text, spec) => {
      take(reply, text, spec);
      repaint();
    }, signal);
    reply.stats.timings = end.timings;
    reply.finish = end.finish;
  }

  async function send(text) {
    const user = { role: "user", content: text };
    state.messages.push(user);
    const body = request(Math.floor(Math.random() * 2 ** 31)); // one seed for both runs
    const reply = newReply();
    state.messages.push(reply);
    running = new AbortController();
    setBusy(true);
    paint();
    try {
      await runInto(reply, body, running.signal);
      if (state.settings.compare) {
        reply.plain = newReply();
        repaint();
        await runInto(reply.plain, { ...body, speculative: { types: [] } }, running.signal);
      }
    } catch (e) {
      if (e.name === "AbortError") live.finish = "stopped"; // the reply or its comparison
      else if (e.status === 401) {
        state.messages.splice(state.messages.indexOf(user), 2);
        $("input").value = text;
        askKey(e.message);
      } else reply.error = e.message;
    } finally {
      running = null;
      setBusy(false);
      save();
      paint();
    }
  }

  // -- painting --------------------------------------------------------------------------
  function rendered(segments, content) {
    const names = [""];
    const origin = [];
    for (const [text, by] of segments || [[content, ""]]) {
      let k = names.indexOf(by);
      if (k < 0) k = names.push(by) - 1;
      for (let i = 0; i < text.length; i++) origin.push(k);
    }
    return Markdown.render(content, origin, names);
  }

  function el(tag, cls, html) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (html !== undefined) node.innerHTML = html;
    return node;
  }

  function comparison(reply) {
    const box = el("div", "compare");
    const on = speed(reply.stats);
    const off = speed(reply.plain.stats);
    box.append(el("div", "side on", `<b>speculation on</b> ${on.toFixed(1)} tok/s`));
    box.append(el("div", "side off", `<b>off</b> ${off.toFixed(1)} tok/s`));
    if (reply.plain.finish === "stopped") {
      box.append(el("div", "verdict", "stopped"));
    } else if (reply.plain.finish) {
      const same = reply.plain.content === reply.content;
      const ratio = off > 0 ? ` · ${(on / off).toFixed(2)}× the speed` : "";
      const verdict = same ? `same text${ratio}` : `the texts differ${ratio}`;
      box.append(el("div", `verdict ${same ? "same" : "differ"}`, verdict));
    } else box.append(el("div", "verdict", "running without speculation…"));
    const details = el("details", "plain");
    details.append(el("summary", "", "the reply without speculation"));
    details.append(el("div", "md", Markdown.render(reply.plain.content, null)));
    box.append(details);
    return box;
  }

  function message(m, index) {
    const node = el("div", `msg ${m.role}`);
    node.dataset.index = index;
    node.append(el("div", "role", m.role === "user" ? "you" : "assistant"));
    const body = m.role === "user" ? Markdown.render(m.content, null) : rendered(m.segments, m.content);
    const streaming = m === live && running;
    node.append(el("div", "body md", body + (streaming ? '<span class="caret"></span>' : "")));
    if (m.role === "assistant") {
      if (m.error) node.append(el("div", "error", Markdown.esc(m.error)));
      const note = m.finish === "stopped" ? " · stopped" : m.finish === "length" ? " · cut at max tokens" : "";
      if (m.stats && (m.stats.tokens || m.stats.timings)) {
        node.append(el("div", "meta", Markdown.esc(summary(m.stats) + note)));
      }
      if (m.plain) node.append(comparison(m));
    }
    return node;
  }

  function legend() {
    const types = new Set();
    for (const m of state.messages) for (const [, by] of m.segments || []) if (by) types.add(by);
    const box = $("legend");
    box.textContent = "";
    if (!types.size) return;
    box.append(el("span", "", "drafted by "));
    for (const t of types) {
      box.append(el("span", `swatch d d-${Markdown.slug(t)}`, Markdown.esc(t)));
    }
  }

  // the latest reply's figures, and its run without speculation when there is one
  function footer() {
    const last = [...state.messages].reverse().find((m) => m.role === "assistant");
    let line = last && last.stats ? summary(last.stats) : "";
    if (last && last.plain) line += ` · without speculation ${speed(last.plain.stats).toFixed(1)} tok/s`;
    $("stats").textContent = line;
  }

  // the conversation again (only its last message while a reply streams in), keeping
  // open what the reader opened and the view at the end if it was there
  function paint(lastOnly) {
    frame = 0;
    const log = $("log");
    const atEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 40;
    const open = new Set(
      [...log.querySelectorAll("details.plain[open]")].map((d) => d.closest(".msg").dataset.index),
    );
    const n = state.messages.length;
    const last = log.lastElementChild;
    if (lastOnly && n && last && last.dataset.index === String(n - 1)) {
      last.replaceWith(message(state.messages[n - 1], n - 1));
    } else {
      log.textContent = "";
      state.messages.forEach((m, i) => log.append(message(m, i)));
    }
    for (const i of open) {
      const details = log.querySelector(`.msg[data-index="${i}"] details.plain`);
      if (details) details.open = true;
    }
    if (!n) {
      log.append(el("div", "empty", "Ask something. Text the target took from accepted drafts is shaded by the speculator that proposed it."));
    }
    legend();
    footer();
    if (atEnd) log.scrollTop = log.scrollHeight;
  }

  function repaint() {
    if (!frame) frame = requestAnimationFrame(() => paint(true));
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.classList.toggle("busy", busy);
  }

  // -- controls --------------------------------------------------------------------------
  function bind(id, key, read) {
    const input = $(id);
    const value = state.settings[key];
    if (input.type === "checkbox") input.checked = Boolean(value);
    else input.value = value;
    input.addEventListener("input", () => {
      state.settings[key] = read(input);
      document.body.classList.toggle("noshade", !state.settings.shade);
      save();
    });
  }

  function start() {
    bind("system", "system", (i) => i.value);
    bind("temperature", "temperature", (i) => i.value);
    bind("max-tokens", "maxTokens", (i) => i.value);
    bind("compare", "compare", (i) => i.checked);
    bind("shade", "shade", (i) => i.checked);
    document.body.classList.toggle("noshade", !state.settings.shade);
    $("key").value = apiKey();
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("input").value;
      if (!text.trim() || running) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => running && running.abort());
    $("clear").addEventListener("click", () => {
      if (running) running.abort();
      state.messages = [];
      live = null;
      save();
      paint();
    });
    $("key-button").addEventListener("click", () => askKey("The key is sent as a bearer token."));
    $("keyform").addEventListener("submit", (e) => {
      e.preventDefault();
      localStorage.setItem(KEY_STORE, $("key").value.trim());
      connect();
    });
    $("log").addEventListener("click", (e) => {
      const button = e.target.closest("button.copy");
      // the clipboard is there only on https or localhost
      if (button && navigator.clipboard) {
        navigator.clipboard.writeText(button.parentElement.querySelector("code").textContent);
      }
    });
    setBusy(false);
    paint();
    connect().catch((e) => askKey(e.message));
  }

  start();
})();
