// The chat page of `pagelm serve`: talks to the server's own /v1/chat/completions (streamed),
// keeps conversations in IndexedDB, and shows what the model costs from /api/ps.
"use strict";

const $ = (selector) => document.querySelector(selector);
const STATS_EVERY_MS = 2000;
const MAX_IMAGE_BYTES = 20 << 20;

// An element with properties and children; text only ever goes in as text nodes.
function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function uid() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

const state = {
  model: null, vision: false, thinks: false,
  conversations: [], current: null, attachments: [], streaming: null,
  settings: JSON.parse(localStorage.getItem("pagelm.settings") || "{}"),
  schemaNext: false,
};

// ---- server ----------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.settings.key) h.Authorization = `Bearer ${state.settings.key}`;
  return h;
}

// The error a failed response describes, with its status and (OpenAI's shape) code.
async function responseError(response) {
  const text = await response.text();
  let message = text || `${response.status} ${response.statusText}`, code = null;
  try {
    const { error } = JSON.parse(text);
    if (error) { message = error.message || error; code = error.code || null; }
  } catch { /* not JSON: the text is the message */ }
  return Object.assign(new Error(message), { status: response.status, code });
}

async function api(path, body) {
  const response = await fetch(path, body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) throw await responseError(response);
  return response.json();
}

async function connect() {
  for (;;) {
    try {
      state.model = (await api("/v1/models")).data[0].id;
      const show = await api("/api/show", { model: state.model });
      state.vision = show.capabilities.includes("vision");
      state.thinks = show.capabilities.includes("thinking");
      break;
    } catch (e) {
      if (e.status === 401) {
        $("#model-name").textContent = "API key needed";
        notice("This server needs an API key: enter it in Settings (⚙).");
        return;
      }
      $("#model-name").textContent = e.status === 503 ? "model loading…" : `unreachable (${e.message})`;
      await new Promise((resolve) => setTimeout(resolve, 1000));
    }
  }
  notice("");
  $("#model-name").textContent = state.model;
  document.title = `pagelm · ${state.model}`;
  $("#think-switch").hidden = !state.thinks;
  $("#think").checked = state.settings.think ?? false;
  $("#attach-label").title = state.vision ? "Attach images (or drop or paste them)"
    : `${state.model} has no vision tower: it cannot read images`;
  $("#image-figures").hidden = !state.vision;
  refreshStats();
}

// Streams one chat completion; calls onDelta(reasoning, content) per chunk and returns
// { usage, finish, requestId, ended }: ended is false when the stream closed before [DONE].
// Aborting `signal` ends it early.
async function streamChat(body, onDelta, signal, onStart) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify({ ...body, stream: true }), signal,
  });
  if (!response.ok) throw await responseError(response);
  const requestId = response.headers.get("X-Request-Id");
  onStart(requestId);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "", usage = null, finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return { usage, finish, requestId, ended: true };
      const chunk = JSON.parse(data);
      if (chunk.error) throw Object.assign(new Error(chunk.error.message), { code: chunk.error.code });
      const choice = chunk.choices && chunk.choices[0];
      if (choice) {
        const delta = choice.delta || {};
        if (delta.reasoning_content || delta.content) onDelta(delta.reasoning_content || "", delta.content || "");
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (chunk.usage) usage = chunk.usage;
    }
  }
  return { usage, finish, requestId, ended: false };
}

// ---- storage (IndexedDB) ---------------------------------------------------------------

const store = {
  db: null,
  open() {
    return new Promise((resolve, reject) => {
      const request = indexedDB.open("pagelm", 1);
      request.onupgradeneeded = () => request.result.createObjectStore("conversations", { keyPath: "id" });
      request.onsuccess = () => { this.db = request.result; resolve(); };
      request.onerror = () => reject(request.error);
    });
  },
  run(mode, action) {
    return new Promise((resolve, reject) => {
      const tx = this.db.transaction("conversations", mode);
      const request = action(tx.objectStore("conversations"));
      tx.oncomplete = () => resolve(request.result);
      tx.onerror = () => reject(tx.error);
    });
  },
  all() { return this.run("readonly", (s) => s.getAll()); },
  put(conversation) { return this.run("readwrite", (s) => s.put(conversation)); },
  remove(id) { return this.run("readwrite", (s) => s.delete(id)); },
};

// A conversation is a tree of messages (edits and regenerations are siblings); `leaf` is the
// end of the branch shown.
function newConversation() {
  return { id: uid(), title: "New chat", created: Date.now(), updated: Date.now(), nodes: {}, leaf: null };
}

function branch(conversation, leaf = conversation.leaf) {
  const path = [];
  for (let id = leaf; id; id = conversation.nodes[id].parent) path.unshift(conversation.nodes[id]);
  return path;
}

function siblings(conversation, node) {
  return Object.values(conversation.nodes).filter((n) => n.parent === node.parent && n.role === node.role)
    .sort((a, b) => a.time - b.time);
}

function latestLeafUnder(conversation, id) {
  for (;;) {
    const children = Object.values(conversation.nodes).filter((n) => n.parent === id);
    if (!children.length) return id;
    id = children.reduce((a, b) => (a.time > b.time ? a : b)).id;
  }
}

function addNode(conversation, fields) {
  const node = { id: uid(), time: Date.now(), content: "", ...fields };
  conversation.nodes[node.id] = node;
  conversation.leaf = node.id;
  return node;
}

async function save(conversation) {
  conversation.updated = Date.now();
  await store.put(conversation);
}

// ---- rendering ---------------------------------------------------------------------------

function setupMarkdown() {
  // Raw HTML in model output is shown as text, never parsed; DOMPurify then checks what marked made.
  const escape = (text) => text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  marked.use({ gfm: true, breaks: false, renderer: { html: (token) => escape(token.text) } });
  hljs.configure({ ignoreUnescapedHTML: true });
}

const PURIFY = {
  FORBID_TAGS: ["style", "img", "svg", "math", "form", "input", "button", "textarea", "select", "iframe"],
  FORBID_ATTR: ["style"],
};

// Markdown into `target` block by block (marked's top-level tokens): a block whose markdown is
// unchanged keeps its nodes, so each frame of a streamed answer renders only its changed end. While
// `growing`, a code block still open at the end is plain text that grows in place; it is
// highlighted once complete.
function renderMarkdown(target, text, growing = false) {
  const blocks = target.blocks ??= [];  // what target shows: { raw, nodes, open } per token
  const tokens = marked.lexer(text);
  const open = growing && tokens.at(-1)?.type === "code" ? tokens.length - 1 : -1;
  let kept = 0;
  while (kept < blocks.length && kept < tokens.length && blocks[kept].raw === tokens[kept].raw
    && blocks[kept].open === (kept === open)) kept++;
  if (kept === open && blocks.length === tokens.length && blocks[open].open) {
    growCode(blocks[open], tokens[open]);
    return;
  }
  for (const block of blocks.splice(kept)) for (const node of block.nodes) node.remove();
  for (let i = kept; i < tokens.length; i++) {
    const block = i === open ? openCodeBlock(tokens[i]) : renderedBlock(tokens[i]);
    target.append(...block.nodes);
    blocks.push(block);
  }
}

function renderedBlock(token) {
  const box = document.createElement("div");
  box.innerHTML = DOMPurify.sanitize(marked.parser([token]), PURIFY);
  for (const code of box.querySelectorAll("pre > code")) {
    hljs.highlightElement(code);
    const copy = el("button", { type: "button", class: "copy-code", text: "Copy" });
    copy.addEventListener("click", () => copyText(code.textContent, copy));
    code.parentElement.append(copy);
  }
  for (const link of box.querySelectorAll("a")) {  // never navigate away from a conversation
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  }
  return { raw: token.raw, nodes: [...box.childNodes], open: false };
}

function openCodeBlock(token) {
  return { raw: token.raw, nodes: [el("pre", {}, el("code", { text: token.text }))], open: true };
}

function growCode(block, token) {
  const code = block.nodes[0].firstChild;
  const shown = code.textContent;
  if (token.text.startsWith(shown)) code.append(token.text.slice(shown.length));
  else code.textContent = token.text;
  block.raw = token.raw;
}

function copyText(text, button) {
  navigator.clipboard.writeText(text).then(() => {
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(() => { button.textContent = label; }, 1200);
  }, () => notice("The browser refused clipboard access."));
}

function formatStats(stats) {
  const parts = [`${stats.prompt_tokens} prompt`, `${stats.cached_tokens} cached`,
    `${stats.completion_tokens} completion`];
  if (stats.ttft_ms != null) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tokens_per_s != null) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  return parts.join(" · ");
}

function messageElement(conversation, node) {
  const article = el("article", { class: `msg ${node.role}`, "data-id": node.id });
  if (node.role === "assistant") {
    const reasoning = el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }),
      el("div", { class: "reasoning-text" }));
    reasoning.open = !node.content;  // open while the model thinks, closed once it answers
    article.append(reasoning);
  }
  if (node.images && node.images.length) {
    article.append(el("div", { class: "images" }, ...node.images.map((src) => el("img", { src, alt: "attached image" }))));
  }
  article.append(el("div", { class: "body" }), el("div", { class: "notes" }), el("div", { class: "stats" }));
  const actions = el("div", { class: "msg-actions" });
  const others = siblings(conversation, node);
  if (others.length > 1) {
    const at = others.findIndex((n) => n.id === node.id);
    const go = (step) => () => switchBranch(conversation, others[at + step]);
    actions.append(
      el("button", { type: "button", class: "prev", text: "‹", title: "Previous version", onclick: go(-1), ...(at === 0 ? { disabled: "" } : {}) }),
      el("span", { class: "branch", text: `${at + 1}/${others.length}` }),
      el("button", { type: "button", class: "next", text: "›", title: "Next version", onclick: go(1), ...(at === others.length - 1 ? { disabled: "" } : {}) }));
  }
  actions.append(el("button", { type: "button", class: "copy", text: "Copy", onclick: (e) => copyText(node.content, e.target) }));
  if (node.role === "user") actions.append(el("button", { type: "button", class: "edit", text: "Edit", onclick: () => startEdit(conversation, node, article) }));
  else actions.append(el("button", { type: "button", class: "regenerate", text: "Regenerate", onclick: () => regenerate(conversation, node) }));
  article.append(actions);
  updateMessage(conversation, article, node);
  return article;
}

// Shows `node` in its article; while `streaming`, only what its latest text changed.
function updateMessage(conversation, article, node, streaming = false) {
  const body = article.querySelector(".body");
  if (node.role === "user") body.textContent = node.content;
  else renderMarkdown(body, node.content, streaming);
  const reasoning = article.querySelector(".reasoning");
  if (reasoning) {
    if (node.content && !article.dataset.answering) {
      article.dataset.answering = "1";
      reasoning.open = false;
    }
    reasoning.hidden = !node.reasoning;
    const text = reasoning.querySelector(".reasoning-text"), shown = text.textContent;
    if (node.reasoning && node.reasoning.startsWith(shown)) text.append(node.reasoning.slice(shown.length));
    else text.textContent = node.reasoning || "";
  }
  article.querySelector(".notes").replaceChildren(...notes(conversation, node));
  const cut = node.finish === "length" ? " · cut at the max-tokens limit" : "";
  article.querySelector(".stats").textContent = node.stats ? formatStats(node.stats) + cut : "";
}

function notes(conversation, node) {
  const found = [];
  if (node.error) found.push(el("p", { class: "error", text: node.error }));
  if (node.overflow) found.push(contextHint(conversation.nodes[node.parent]));
  if (node.stopped) found.push(el("p", { class: "stopped", text: "(stopped)" }));
  if (node.interrupted) {
    found.push(el("p", { class: "interrupted", text: "(interrupted: the connection closed before the answer ended)" }));
  }
  return found;
}

// What to do once the conversation (or the message alone) is longer than the model's context.
function contextHint(question) {
  if (!question.parent) return el("p", { class: "context-hint", text: "This message alone does not fit the model's context: shorten it." });
  return el("p", { class: "context-hint" }, "This conversation no longer fits the model's context. ",
    el("button", { type: "button", class: "carry-over", text: "New chat with this message",
      onclick: () => carryOver(question) }));
}

async function carryOver(question) {
  await createConversation();
  $("#input").value = question.content;
  fitInput();
  state.attachments = (question.images || []).slice();
  renderAttachments();
}

function nearBottom(box) {
  return box.scrollHeight - box.scrollTop - box.clientHeight < 40;
}

function renderConversation() {
  const box = $("#messages");
  box.replaceChildren();
  const conversation = state.current;
  const path = conversation ? branch(conversation) : [];
  if (!path.length) box.append(el("p", { class: "empty", text: state.model ? `Ask ${state.model} anything.` : "" }));
  for (const node of path) box.append(messageElement(conversation, node));
  box.scrollTop = box.scrollHeight;
  renderList();
}

function renderList() {
  const list = $("#chat-list");
  list.replaceChildren();
  for (const conversation of [...state.conversations].sort((a, b) => b.updated - a.updated)) {
    const item = el("li", { class: conversation === state.current ? "active" : "", "data-id": conversation.id });
    const title = el("button", { type: "button", class: "title", text: conversation.title, title: conversation.title });
    title.addEventListener("click", () => openConversation(conversation));
    const rename = el("button", { type: "button", class: "act rename", text: "Rename", title: "Rename" });
    rename.addEventListener("click", () => startRename(conversation, item));
    const remove = el("button", { type: "button", class: "act delete", text: "Delete", title: "Delete" });
    remove.addEventListener("click", () => {
      if (!remove.classList.contains("confirm")) {
        remove.classList.add("confirm");
        remove.textContent = "Sure?";
        return;
      }
      deleteConversation(conversation);
    });
    item.append(title, rename, remove);
    list.append(item);
  }
}

function startRename(conversation, item) {
  const input = el("input", { type: "text", value: conversation.title, "aria-label": "New title" });
  const finish = async (keep) => {
    if (keep && input.value.trim()) {
      conversation.title = input.value.trim();
      await save(conversation);
    }
    renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); finish(true); }
    if (e.key === "Escape") { e.stopPropagation(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

// ---- conversations -----------------------------------------------------------------------

function openConversation(conversation) {
  if (state.streaming) stop();
  state.current = conversation;
  localStorage.setItem("pagelm.current", conversation.id);
  $("#chats").classList.remove("open");
  renderConversation();
}

async function createConversation() {
  const conversation = newConversation();
  state.conversations.push(conversation);
  await save(conversation);
  openConversation(conversation);
  $("#input").focus();
}

async function deleteConversation(conversation) {
  state.conversations = state.conversations.filter((c) => c !== conversation);
  if (state.streaming && state.streaming.conversation === conversation) stop();
  await store.remove(conversation.id);
  if (state.current === conversation) {
    if (state.conversations.length) openConversation(state.conversations[state.conversations.length - 1]);
    else await createConversation();
  } else renderList();
}

function exportConversations() {
  const blob = new Blob([JSON.stringify({ pagelm: 1, conversations: state.conversations }, null, 2)],
    { type: "application/json" });
  const link = el("a", { href: URL.createObjectURL(blob), download: `pagelm-chats-${new Date().toISOString().slice(0, 10)}.json` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importConversations(file) {
  try {
    const data = JSON.parse(await file.text());
    const found = Array.isArray(data) ? data : data.conversations;
    if (!Array.isArray(found) || !found.every((c) => c && typeof c.id === "string" && c.nodes && typeof c.nodes === "object")) {
      throw new Error("not a pagelm export (expected {conversations: [...]})");
    }
    if (!found.length) throw new Error("it holds no conversations");
    for (const conversation of found) {
      state.conversations = state.conversations.filter((c) => c.id !== conversation.id);
      state.conversations.push(conversation);
      await save(conversation);
    }
    openConversation(found[found.length - 1]);
  } catch (e) {
    notice(`Could not import ${file.name}: ${e.message}`);
  }
}

function switchBranch(conversation, node) {
  conversation.leaf = latestLeafUnder(conversation, node.id);
  save(conversation);
  renderConversation();
}

function startEdit(conversation, node, article) {
  if (state.streaming) return;
  const input = el("textarea", { rows: "3", "aria-label": "Edit message" });
  input.value = node.content;
  const done = el("button", { type: "button", class: "save-edit", text: "Send" });
  const cancel = el("button", { type: "button", text: "Cancel", onclick: () => renderConversation() });
  done.addEventListener("click", () => {
    const text = input.value.trim();
    if (!text) return;
    const edited = addNode(conversation, { parent: node.parent, role: "user", content: text, images: node.images });
    generate(conversation, edited);
  });
  article.querySelector(".body").replaceChildren(el("div", { class: "edit-box" }, input, done, cancel));
  input.focus();
}

function regenerate(conversation, answer) {
  if (state.streaming) return;
  generate(conversation, conversation.nodes[answer.parent]);
}

// ---- generation --------------------------------------------------------------------------

function requestMessages(conversation, upTo) {
  const messages = [];
  const system = (state.settings.system || "").trim();
  if (system) messages.push({ role: "system", content: system });
  for (const node of branch(conversation, upTo.id)) {
    if (node.images && node.images.length) {
      messages.push({ role: node.role, content: [{ type: "text", text: node.content },
        ...node.images.map((url) => ({ type: "image_url", image_url: { url } }))] });
    } else messages.push({ role: node.role, content: node.content });
  }
  return messages;
}

function requestBody(conversation, upTo) {
  const body = { model: state.model, messages: requestMessages(conversation, upTo) };
  const s = state.settings;
  for (const key of ["temperature", "top_p", "max_tokens", "seed"]) {
    if (s[key] !== undefined && s[key] !== "") body[key] = Number(s[key]);
  }
  if (state.thinks) body.chat_template_kwargs = { enable_thinking: $("#think").checked };
  if (state.schemaNext && s.schema) {  // for this one message: then the schema is cleared
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(s.schema) } };
    state.schemaNext = false;
    s.schema = "";
    localStorage.setItem("pagelm.settings", JSON.stringify(s));
    $("#schema-flag").hidden = true;
  }
  return body;
}

async function generate(conversation, userNode) {
  const answer = addNode(conversation, { parent: userNode.id, role: "assistant", reasoning: "" });
  const title = conversation.title === "New chat" && userNode.content.trim();
  if (title) conversation.title = title.length > 48 ? `${title.slice(0, 48)}…` : title;
  await save(conversation);
  renderConversation();
  const article = $(`#messages [data-id="${answer.id}"]`);
  const box = $("#messages");
  const controller = new AbortController();
  const run = { controller, requestId: null, conversation };
  state.streaming = run;
  setBusy(true);
  const sent = performance.now();
  let first = null, pending = false;
  const paint = (streaming) => {
    pending = false;
    const follow = nearBottom(box);
    updateMessage(conversation, article, answer, streaming);
    if (follow) box.scrollTop = box.scrollHeight;
  };
  try {
    const result = await streamChat(requestBody(conversation, userNode), (reasoning, content) => {
      if (first === null) first = performance.now();
      answer.reasoning += reasoning;
      answer.content += content;
      if (!pending) { pending = true; requestAnimationFrame(() => pending && paint(true)); }
    }, controller.signal, (id) => { run.requestId = id; });
    const end = performance.now();
    if (result.usage) {
      const u = result.usage;
      const decodeS = first === null ? 0 : (end - first) / 1000;
      answer.stats = {
        prompt_tokens: u.prompt_tokens, completion_tokens: u.completion_tokens,
        cached_tokens: (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0,
        ttft_ms: first === null ? null : first - sent,
        tokens_per_s: decodeS > 0 && u.completion_tokens > 1 ? (u.completion_tokens - 1) / decodeS : null,
      };
    }
    answer.finish = result.finish;
    if (!result.ended) answer.interrupted = true;
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else {
      answer.error = e.message;
      if (e.code === "context_length_exceeded") answer.overflow = true;
    }
  } finally {
    state.streaming = null;
    paint(false);  // a frame still pending then paints nothing
    if (state.conversations.includes(conversation)) await save(conversation);  // unless deleted meanwhile
    setBusy(false);
    document.body.dataset.answered = Number(document.body.dataset.answered || 0) + 1;  // for tests to wait on
    refreshStats();
  }
}

function stop() {
  const run = state.streaming;
  if (!run || run.controller.signal.aborted) return;  // asked once is enough: the server forgets the id
  if (run.requestId) {
    fetch("/api/cancel", { method: "POST", headers: headers(), body: JSON.stringify({ id: run.requestId }) })
      .catch(() => {});
  }
  run.controller.abort();
}

function fitInput() {
  const input = $("#input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight + 2, window.innerHeight * 0.4)}px`;
}

function setBusy(busy) {
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
}

async function send() {
  if (state.streaming || !state.model) return;
  const input = $("#input");
  const text = input.value.trim();
  if (!text && !state.attachments.length) return;
  if (state.schemaNext) {
    try { JSON.parse(state.settings.schema); } catch (e) { notice(`The JSON schema is not valid JSON: ${e.message}`); return; }
  }
  notice("");
  const conversation = state.current;
  const userNode = addNode(conversation, { parent: conversation.leaf, role: "user", content: text,
    images: state.attachments.slice() });
  input.value = "";
  fitInput();
  state.attachments = [];
  renderAttachments();
  await generate(conversation, userNode);
}

// ---- images --------------------------------------------------------------------------------

function attach(files) {
  const images = [...files].filter((f) => f.type.startsWith("image/"));
  if (!images.length) return;
  if (!state.vision) {
    notice(`${state.model || "This model"} has no vision tower: it cannot read images, so none was attached.`);
    return;
  }
  for (const file of images) {
    if (file.size > MAX_IMAGE_BYTES) { notice(`${file.name} is over ${MAX_IMAGE_BYTES >> 20} MiB.`); continue; }
    const reader = new FileReader();
    reader.onload = () => { state.attachments.push(reader.result); renderAttachments(); };
    reader.readAsDataURL(file);
  }
}

function renderAttachments() {
  $("#attachments").replaceChildren(...state.attachments.map((src, i) => el("figure", {},
    el("img", { src, alt: "image to send" }),
    el("button", { type: "button", text: "×", title: "Remove", onclick: () => { state.attachments.splice(i, 1); renderAttachments(); } }))));
}

// ---- side panel ------------------------------------------------------------------------------

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function figure(name, value) {
  const node = document.querySelector(`[data-figure="${name}"]`);
  if (node) node.textContent = value;
}

async function refreshStats() {
  if (!state.model || document.hidden) return;
  let ps;
  try { ps = await api("/api/ps"); } catch { return; }
  const model = ps.models[0] || {};
  const memory = ps.memory, prefix = ps.prefix_cache, requests = ps.requests, images = ps.image_cache || {};
  figure("file", model.file || model.name || "–");
  figure("size", bytes(model.size));
  figure("anonymous", bytes(memory.anonymous_bytes));
  figure("file_rss", bytes(memory.file_rss_bytes));
  figure("weights_anonymous", bytes(memory.weights_anonymous_bytes));
  figure("peak_rss", bytes(memory.peak_rss_bytes));
  figure("prefix_entries", prefix.enabled === false ? "off" : `${prefix.entries}`);
  figure("prefix_hits", `${prefix.hits} / ${prefix.lookups}`);
  figure("prefix_tokens", `${prefix.tokens_reused}`);
  figure("prefix_bytes", bytes(prefix.bytes_held));
  figure("image_entries", `${images.entries ?? 0}`);
  figure("tower_passes", `${images.tower_passes ?? 0}`);
  figure("slots", `${ps.slots.busy ?? 0} / ${ps.slots.total ?? 0}`);
  figure("queued", `${requests.queued}`);
  figure("served", `${requests.served}`);
  figure("cancelled", `${requests.cancelled}`);
  $("#replica-figures").hidden = !ps.replicas;
  if (ps.replicas) figure("replicas", `${ps.replicas.length}`);
}

// ---- settings, theme, notices ----------------------------------------------------------------

function notice(text) {
  const box = $("#notice");
  box.textContent = text;
  box.hidden = !text;
}

const SETTING_FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed", "schema", "key"];

function openSettings() {
  for (const key of SETTING_FIELDS) $(`#set-${key}`).value = state.settings[key] ?? "";
  $("#settings-error").hidden = true;
  $("#settings").showModal();
}

function saveSettings(event) {
  const values = Object.fromEntries(SETTING_FIELDS.map((key) => [key, $(`#set-${key}`).value.trim()]));
  if (values.schema) {
    try { JSON.parse(values.schema); } catch (e) {
      event.preventDefault();
      const error = $("#settings-error");
      error.textContent = `The JSON schema is not valid JSON: ${e.message}`;
      error.hidden = false;
      return;
    }
  }
  const keyChanged = values.key !== (state.settings.key || "");
  state.settings = { ...state.settings, ...values };
  state.schemaNext = Boolean(values.schema);
  $("#schema-flag").hidden = !state.schemaNext;
  localStorage.setItem("pagelm.settings", JSON.stringify(state.settings));
  if (keyChanged || !state.model) connect();
}

const THEMES = ["auto", "light", "dark"];

function applyTheme() {
  const chosen = localStorage.getItem("pagelm.theme") || "auto";
  const dark = chosen === "dark" || (chosen === "auto" && matchMedia("(prefers-color-scheme: dark)").matches);
  document.documentElement.dataset.theme = dark ? "dark" : "light";
  $("#hljs-dark").disabled = !dark;
  $("#hljs-light").disabled = dark;
  $("#theme").title = `Theme: ${chosen}`;
}

// ---- wiring -----------------------------------------------------------------------------------

function wire() {
  $("#composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("#input").addEventListener("input", fitInput);
  $("#input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.streaming) { e.preventDefault(); stop(); }
  });
  $("#stop").addEventListener("click", stop);
  $("#new-chat").addEventListener("click", createConversation);
  $("#export-chats").addEventListener("click", exportConversations);
  $("#import-chats").addEventListener("change", (e) => { if (e.target.files[0]) importConversations(e.target.files[0]); e.target.value = ""; });
  $("#attach").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
  $("#input").addEventListener("paste", (e) => {
    const files = [...e.clipboardData.files];
    if (files.some((f) => f.type.startsWith("image/"))) { e.preventDefault(); attach(files); }
  });
  const main = $("#main");
  main.addEventListener("dragover", (e) => { e.preventDefault(); main.classList.add("dragging"); });
  main.addEventListener("dragleave", () => main.classList.remove("dragging"));
  main.addEventListener("drop", (e) => { e.preventDefault(); main.classList.remove("dragging"); attach(e.dataTransfer.files); });
  $("#think").addEventListener("change", (e) => {
    state.settings.think = e.target.checked;
    localStorage.setItem("pagelm.settings", JSON.stringify(state.settings));
  });
  $("#open-settings").addEventListener("click", openSettings);
  // submit comes only once the form's fields are valid; Cancel (formnovalidate) closes without saving
  $("#settings form").addEventListener("submit", (e) => { if (e.submitter === $("#save-settings")) saveSettings(e); });
  $("#theme").addEventListener("click", () => {
    const now = localStorage.getItem("pagelm.theme") || "auto";
    localStorage.setItem("pagelm.theme", THEMES[(THEMES.indexOf(now) + 1) % THEMES.length]);
    applyTheme();
  });
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", applyTheme);
  $("#toggle-chats").addEventListener("click", () => { $("#chats").classList.toggle("open"); $("#panel").classList.remove("open"); });
  $("#toggle-panel").addEventListener("click", () => { $("#panel").classList.toggle("open"); $("#chats").classList.remove("open"); });
  document.addEventListener("visibilitychange", refreshStats);
  setInterval(refreshStats, STATS_EVERY_MS);
}

async function start() {
  applyTheme();
  setupMarkdown();
  wire();
  await store.open();
  state.conversations = await store.all();
  const last = localStorage.getItem("pagelm.current");
  const current = state.conversations.find((c) => c.id === last);
  if (current) openConversation(current);
  else await createConversation();
  await connect();
  renderConversation();
}

start();
