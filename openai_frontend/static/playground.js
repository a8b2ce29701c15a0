// The chat playground: streams /v1/chat/completions (server-sent events) into the page. No framework and no
// build step; everything it loads comes from this server. Model text only ever enters the page as text
// (textContent, text nodes, markdown.js), never as HTML.
"use strict";
(function () {
  const KEY = "qwen3-playground-api-key";   // sessionStorage only: gone when the tab closes
  const $ = (id) => document.getElementById(id);
  const state = { history: [], controller: null, busy: false };
  window.playground = { replies: [], state };   // for the browser tests: each reply's raw text and figures

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  function status(text) { $("status").textContent = text; }

  function askForKey(message) {
    $("key-panel").hidden = false;
    if (message) $("key-panel").querySelector("p").textContent = message;
    $("key-input").focus();
  }

  async function errorText(res) {
    try {
      const body = await res.json();
      return (body.error && body.error.message) || JSON.stringify(body);
    } catch (_) {
      return res.status + " " + res.statusText;
    }
  }

  async function loadModels() {
    const res = await fetch("/v1/models", { headers: headers() });
    if (res.status === 401) { askForKey(); status("API key required"); return; }
    if (!res.ok) { status("models: " + await errorText(res)); return; }
    const select = $("model"), previous = select.value;
    select.replaceChildren();
    for (const m of (await res.json()).data) select.appendChild(el("option", null, m.id));
    if ([...select.options].some((o) => o.value === previous)) select.value = previous;
    status(select.options.length ? "" : "no model is ready");
  }

  function number(id, integer) {
    const v = $(id).value.trim();
    if (v === "") return undefined;
    const n = integer ? parseInt(v, 10) : parseFloat(v);
    if (Number.isNaN(n)) throw new Error(id + " must be a number");
    return n;
  }

  function requestBody(messages) {
    const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
                   chat_template_kwargs: { enable_thinking: $("thinking").checked } };
    for (const [id, integer] of [["temperature", false], ["top_p", false], ["max_tokens", true], ["seed", true]]) {
      const v = number(id, integer);
      if (v !== undefined) body[id] = v;
    }
    if ($("json_mode").checked) {
      let schema;
      try { schema = JSON.parse($("schema").value); } catch (e) { throw new Error("JSON schema: " + e.message); }
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
    }
    if ($("tools_mode").checked) {
      try { body.tools = JSON.parse($("tools").value); } catch (e) { throw new Error("tools: " + e.message); }
      body.tool_choice = $("tool_choice").value;
    }
    return body;
  }

  function addUserMessage(text) {
    const div = el("div", "msg user");
    div.appendChild(el("div", "role", "you"));
    div.appendChild(el("div", "content plain", text));
    $("messages").appendChild(div);
  }

  // One assistant reply: thinking (collapsible), content (markdown), tool calls, and its figures.
  class Reply {
    constructor(model) {
      this.div = el("div", "msg assistant");
      this.div.appendChild(el("div", "role", model));
      this.thinking = el("details", "thinking");
      this.thinking.hidden = true;
      this.thinking.open = true;
      this.thinking.appendChild(el("summary", null, "Thinking"));
      this.thinkingText = el("div", "thinking-text");
      this.thinking.appendChild(this.thinkingText);
      this.contentDiv = el("div", "content");
      this.callsDiv = el("div", "tool-calls");
      this.stats = el("div", "stats");
      this.div.append(this.thinking, this.contentDiv, this.callsDiv, this.stats);
      $("messages").appendChild(this.div);
      window.playground.replies.push(this);
      this.reasoning = ""; this.content = ""; this.calls = []; this.chunks = 0;
      this.t0 = performance.now(); this.tFirst = null; this.usage = null; this.finish = null;
      this.pending = false;
    }

    delta(d) {
      if (this.tFirst === null && (d.reasoning_content || d.content || d.tool_calls)) this.tFirst = performance.now();
      if (d.reasoning_content) {
        this.reasoning += d.reasoning_content;
        this.thinking.hidden = false;
        this.thinkingText.textContent = this.reasoning;
      }
      if (d.content) {
        if (!this.content && this.reasoning) this.thinking.open = false;   // the answer started: fold the thinking
        this.content += d.content;
        this.schedule();
      }
      for (const tc of d.tool_calls || []) {
        const call = this.calls[tc.index] || (this.calls[tc.index] = { id: "", type: "function", function: { name: "", arguments: "" } });
        if (tc.id) call.id = tc.id;
        if (tc.function && tc.function.name) call.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
        this.renderCalls();
      }
      this.chunks++;
    }

    schedule() {   // re-render the markdown at most once per frame
      if (this.pending) return;
      this.pending = true;
      requestAnimationFrame(() => { this.pending = false; renderMarkdown(this.content, this.contentDiv); scrollDown(); });
    }

    renderCalls() {
      this.callsDiv.replaceChildren();
      for (const call of this.calls.filter(Boolean)) {
        const box = el("div", "tool-call");
        box.appendChild(el("div", "tool-name", "tool call: " + call.function.name));
        let args = call.function.arguments;
        try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* partial or not JSON: as is */ }
        box.appendChild(el("pre", "tool-args", args));
        this.callsDiv.appendChild(box);
      }
    }

    error(message) { this.div.appendChild(el("div", "error", message)); }

    done(stopped) {
      renderMarkdown(this.content, this.contentDiv);
      const end = performance.now(), parts = [];
      if (this.tFirst !== null) parts.push("TTFT " + Math.round(this.tFirst - this.t0) + " ms");
      const u = this.usage;
      if (u && this.tFirst !== null) {
        const gen = u.completion_tokens, secs = (end - this.tFirst) / 1000;
        if (gen > 1 && secs > 0) parts.push(((gen - 1) / secs).toFixed(1) + " tokens/s");
        parts.push(u.prompt_tokens + " prompt tokens");
        const cached = u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens;
        if (cached !== undefined && cached !== null) parts.push(cached + " from the prefix cache");
        parts.push(gen + " generated");
      }
      if (stopped) parts.push("stopped");
      else if (this.finish) parts.push("finish: " + this.finish);
      this.stats.textContent = parts.join(" · ");
      this.div.dataset.state = stopped ? "stopped" : "done";
    }

    message() {   // the turn as history for the next request (the thinking is not sent back, as Qwen3's template drops it)
      const m = { role: "assistant", content: this.content };
      const calls = this.calls.filter(Boolean);
      if (calls.length) m.tool_calls = calls;
      return m;
    }
  }

  function scrollDown() { const m = $("messages"); m.scrollTop = m.scrollHeight; }

  function setBusy(busy) {
    state.busy = busy;
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  async function send(text) {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...state.history, { role: "user", content: text });
    let body;
    try { body = requestBody(messages); } catch (e) { status(e.message); return; }
    addUserMessage(text);
    const reply = new Reply(body.model);
    scrollDown();
    state.controller = new AbortController();
    setBusy(true);
    let stopped = false;
    try {
      const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                      signal: state.controller.signal });
      if (res.status === 401) askForKey();
      if (!res.ok) { reply.error(await errorText(res)); reply.done(false); return; }
      await readEvents(res, reply);
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else reply.error(String(e.message || e));
    } finally {
      state.controller = null;
      setBusy(false);
    }
    reply.done(stopped);
    state.history.push({ role: "user", content: text }, reply.message());
  }

  async function readEvents(res, reply) {
    const reader = res.body.getReader(), decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) { reply.error(chunk.error.message); continue; }
          if (chunk.usage) reply.usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            reply.delta(choice.delta || {});
            if (choice.finish_reason) reply.finish = choice.finish_reason;
          }
        }
      }
    }
  }

  function init() {
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("input").value;
      if (!text.trim() || state.busy) return;
      $("input").value = "";
      send(text);
    });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
    $("clear").addEventListener("click", () => { state.history = []; $("messages").replaceChildren(); });
    $("json_mode").addEventListener("change", () => { $("schema").hidden = !$("json_mode").checked; });
    $("tools_mode").addEventListener("change", () => { $("tools_panel").hidden = !$("tools_mode").checked; });
    $("key-button").addEventListener("click", () => askForKey("API key for this server (kept in this tab's session only)."));
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      sessionStorage.setItem(KEY, $("key-input").value);
      $("key-input").value = "";
      $("key-panel").hidden = true;
      loadModels();
    });
    loadModels();
  }

  init();
})();
