// The page of `nmt serve`: a client of the server's public API, like any other.
//   GET languages, GET v1/limits  -> the language selects, the limits, the API key field
//   POST translate                -> the translation (LibreTranslate's API)
// Paths are relative, so the page works behind a proxy that serves it under a prefix.
// Server text is only ever set as textContent: a translation is text, never markup.
"use strict";

const DEBOUNCE_MS = 600;  // translate this long after the last keystroke
const FILE_RETRIES = 5;  // a file's chunk answered 503 (queue full) is retried this often

const el = {};  // the page's elements by id, filled by init()
const state = {
  languages: new Map(),  // code -> {code, name, targets} from GET languages
  limits: null,  // GET v1/limits: {max_chars, max_lines, max_body_bytes, api_key_required}
  request: null,  // the interactive translation in flight: {controller}
  timer: 0,  // the pending debounced translation
  fileRun: 0,  // bumped per file: a file chosen later supersedes one in progress
  downloadUrl: null,  // the object URL of the last translated file
};

/** An error the server answered (status > 0) or a failed connection (status 0). */
class ApiError extends Error {
  constructor(message, status, retryAfter = 0) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

// --- talking to the server ------------------------------------------------------------

/** GET `path` (no body) or POST `body` as JSON; the answer's JSON, or an ApiError carrying
 *  the server's one-line message. An AbortError passes through. */
async function callApi(path, body, signal) {
  const init = body === undefined ? {signal} : {
    method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify(body), signal,
  };
  let response, text;
  try {
    response = await fetch(path, init);
    text = await response.text();
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(`Cannot reach the server (${err.message})`, 0);
  }
  let data = null;
  try {
    data = JSON.parse(text);
  } catch {
    // Not JSON: a proxy's error page, say; the status line then says what happened.
  }
  if (!response.ok) {
    const message = data && typeof data.error === "string" ? data.error
      : `The server answered ${response.status} ${response.statusText}`.trim();
    const retryAfter = Number(response.headers.get("Retry-After")) || 0;
    throw new ApiError(oneLine(message), response.status, retryAfter);
  }
  if (data === null) throw new ApiError("The server's answer is not JSON", response.status);
  return data;
}

/** `body` with the API key when one is asked for and given. */
function withKey(body) {
  const key = el.apiKey.value.trim();
  return !el.keyBox.hidden && key ? {...body, api_key: key} : body;
}

/** The alternatives field as sent: a number, or the raw text for the server to refuse. */
function alternatives() {
  const raw = el.nbest.value.trim();
  if (raw === "") return 0;
  return Number.isInteger(Number(raw)) ? Number(raw) : raw;
}

// --- messages -------------------------------------------------------------------------

function oneLine(text) {
  return String(text).replace(/\s+/g, " ").trim();
}

/** Show an error in the alert area (read out by screen readers); a 403 shows the key field. */
function showError(message, status) {
  el.status.textContent = oneLine(message);
  if (status === 403) el.keyBox.hidden = false;
}

function clearError() {
  el.status.textContent = "";
}

function note(message) {
  el.note.textContent = message;
}

// --- languages ------------------------------------------------------------------------

function languageName(code) {
  const lang = state.languages.get(code);
  return lang && lang.name && lang.name !== code ? lang.name : code;
}

function serves(source, target) {
  const lang = state.languages.get(source);
  return Boolean(lang && lang.targets.includes(target));
}

/** Replace a select's options with `codes`, keeping `keep` selected where it remains. */
function setOptions(select, codes, keep) {
  select.replaceChildren(...codes.map((code) => {
    const option = document.createElement("option");
    option.value = code;
    option.textContent = languageName(code);
    return option;
  }));
  if (codes.includes(keep)) select.value = keep;
}

function fillLanguages(list) {
  for (const lang of list) state.languages.set(lang.code, lang);
  const sources = list.filter((lang) => lang.targets.length > 0);
  setOptions(el.source, sources.map((lang) => lang.code));
  fillTargets();
  const pairs = sources.flatMap((lang) => lang.targets.map(
    (target) => `${languageName(lang.code)} \u2192 ${languageName(target)}`));
  el.served.textContent = pairs.length ? `Serving ${pairs.join(", ")}.`
    : "This server serves no language pair.";
}

/** The target select for the chosen source; swap enabled only where the reverse is served. */
function fillTargets() {
  const source = state.languages.get(el.source.value);
  setOptions(el.target, source ? source.targets : [], el.target.value);
  updateSwap();
}

function updateSwap() {
  el.swap.disabled = !serves(el.target.value, el.source.value);
}

/** Reverse the pair; the translation becomes the text to translate back. */
function swap() {
  const [source, target] = [el.source.value, el.target.value];
  if (!serves(target, source)) return;
  el.source.value = target;
  fillTargets();
  el.target.value = source;
  updateSwap();
  if (el.output.textContent) el.text.value = el.output.textContent;
  updateCounter();
  translateNow();
}

// --- the text -------------------------------------------------------------------------

/** "N / max_chars" for the longest line (the server's limit is per line, in code points),
 *  and a warning before the server would refuse the text. */
function updateCounter() {
  const lines = el.text.value.split("\n");
  const longest = lines.reduce((most, line) => Math.max(most, [...line].length), 0);
  const limits = state.limits;
  if (!limits) {
    el.counter.textContent = `${longest} characters`;
    return;
  }
  const over = longest > limits.max_chars;
  el.counter.textContent = `${longest} / ${limits.max_chars}`;
  el.counter.classList.toggle("over", over);
  el.limitWarning.textContent = over
    ? `Too long: the server takes at most ${limits.max_chars} characters per line.`
    : lines.length > limits.max_lines
      ? `Too many lines: the server takes at most ${limits.max_lines} at once (translate them as a file).`
      : "";
}

function scheduleTranslation() {
  clearTimeout(state.timer);
  state.timer = setTimeout(translateNow, DEBOUNCE_MS);
}

/** Translate the text now; a newer call aborts this one, and a stale answer is dropped. */
async function translateNow() {
  clearTimeout(state.timer);
  if (state.request) state.request.controller.abort();
  updateCounter();  // the text may have come without an input event (restored, set)
  const text = el.text.value;
  if (!text.trim()) {
    state.request = null;
    showTranslation("", [], "");
    clearError();
    return;
  }
  const request = {controller: new AbortController()};
  state.request = request;
  el.time.textContent = "translating\u2026";
  const body = withKey({q: text, source: el.source.value, target: el.target.value,
                        format: "text", alternatives: alternatives()});
  const started = performance.now();
  try {
    const data = await callApi("translate", body, request.controller.signal);
    if (state.request !== request) return;
    const seconds = (performance.now() - started) / 1000;
    showTranslation(String(data.translatedText ?? ""), data.alternatives || [],
                    `${seconds.toFixed(2)} s`);
    clearError();
  } catch (err) {
    if (err.name === "AbortError" || state.request !== request) return;
    showTranslation("", [], "");
    showError(err.message, err.status);
  } finally {
    if (state.request === request) state.request = null;
  }
}

/** The translation, its alternatives (a list, shown only when there are some) and time. */
function showTranslation(text, alternatives, time) {
  el.output.textContent = text;
  el.alternatives.replaceChildren(...alternatives.map((alternative) => {
    const item = document.createElement("li");
    item.textContent = String(alternative);
    return item;
  }));
  el.alternativesBox.hidden = alternatives.length === 0;
  el.time.textContent = time;
  note("");
}

/** Copy the translation; where the browser has no clipboard for this page (plain http on
 *  another host than localhost), select it for Ctrl+C and say so. */
async function copyTranslation() {
  const text = el.output.textContent;
  if (!text) {
    note("Nothing to copy yet.");
    return;
  }
  try {
    if (!navigator.clipboard || !window.isSecureContext) throw new Error("no clipboard");
    await navigator.clipboard.writeText(text);
    note("Copied.");
  } catch {
    window.getSelection().selectAllChildren(el.output);
    note("This browser lets the page copy only over https or on localhost: the translation "
         + "is selected, press Ctrl+C.");
  }
}

// --- a file -----------------------------------------------------------------------------

/** The file's lines, its line break and whether it ends with one (kept in the output). */
function splitLines(text) {
  const eol = text.includes("\r\n") ? "\r\n" : "\n";
  const lines = text.split(/\r?\n/);
  const trailing = lines.length > 1 && lines[lines.length - 1] === "";
  if (trailing) lines.pop();
  return {lines, eol, trailing};
}

/** Indices of the lines to send, cut into requests the server takes: at most max_lines
 *  lines and, with room for the rest of the request, at most max_body_bytes of JSON. */
function chunks(indices, lines) {
  const {max_lines: maxLines, max_body_bytes: maxBytes} = state.limits;
  const budget = Math.max(maxBytes - 1024, maxBytes / 2);
  const encoder = new TextEncoder();
  const result = [];
  let current = [];
  let bytes = 0;
  for (const i of indices) {
    const size = encoder.encode(JSON.stringify(lines[i])).length + 1;
    if (current.length && (current.length >= maxLines || bytes + size > budget)) {
      result.push(current);
      current = [];
      bytes = 0;
    }
    current.push(i);
    bytes += size;
  }
  if (current.length) result.push(current);
  return result;
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** `call()`, again after Retry-After while the server answers 503 (its queue is full). */
async function withRetry(call) {
  for (let attempt = 1; ; attempt++) {
    try {
      return await call();
    } catch (err) {
      if (err.status !== 503 || attempt >= FILE_RETRIES) throw err;
      await sleep(1000 * (err.retryAfter || 1));
    }
  }
}

function fileProgress(done, total, message) {
  el.progress.hidden = false;
  el.progress.max = Math.max(total, 1);
  el.progress.value = done;
  el.fileStatus.textContent = message;
}

/** Translate the chosen .txt file line by line: empty lines are kept as they are, the
 *  others sent in chunks the server takes; then offer `<name>.<target>.txt`. */
async function translateFile() {
  const file = el.file.files[0];
  if (!file) return;
  const run = ++state.fileRun;
  el.download.hidden = true;
  if (!state.limits) {
    showError("The server's limits are not known yet: reload the page.");
    return;
  }
  let text;
  try {
    text = await file.text();
  } catch (err) {
    showError(`${file.name}: cannot read it (${err.message})`);
    return;
  }
  const {lines, eol, trailing} = splitLines(text);
  const todo = lines.flatMap((line, i) => (line.trim() ? [i] : []));
  const out = lines.map(() => "");
  const [source, target] = [el.source.value, el.target.value];
  clearError();
  let done = 0;
  fileProgress(0, todo.length, `${file.name}: translating ${todo.length} lines\u2026`);
  for (const indices of chunks(todo, lines)) {
    const body = withKey({q: indices.map((i) => lines[i]), source, target, format: "text"});
    let data;
    try {
      data = await withRetry(() => callApi("translate", body));
    } catch (err) {
      if (run !== state.fileRun) return;
      const where = `lines ${indices[0] + 1}-${indices[indices.length - 1] + 1}`;
      el.progress.hidden = true;
      el.fileStatus.textContent = "";
      showError(`${file.name}, ${where}: ${err.message}`, err.status);
      return;
    }
    if (run !== state.fileRun) return;  // another file was chosen meanwhile
    data.translatedText.forEach((translation, k) => { out[indices[k]] = translation; });
    done += indices.length;
    fileProgress(done, todo.length, `${file.name}: ${done} of ${todo.length} lines translated`);
  }
  offerDownload(file.name, target, out.join(eol) + (trailing ? eol : ""), lines.length);
}

function offerDownload(fileName, target, content, lineCount) {
  if (state.downloadUrl) URL.revokeObjectURL(state.downloadUrl);
  state.downloadUrl = URL.createObjectURL(new Blob([content], {type: "text/plain;charset=utf-8"}));
  const name = `${fileName.replace(/\.txt$/i, "")}.${target}.txt`;
  el.download.href = state.downloadUrl;
  el.download.download = name;
  el.download.textContent = `Download ${name}`;
  el.download.hidden = false;
  el.fileStatus.textContent = `${fileName}: ${lineCount} lines, done.`;
}

// --- start ------------------------------------------------------------------------------

async function init() {
  for (const id of ["form", "served", "source", "target", "swap", "text", "counter", "output",
                    "copy", "time", "note", "nbest", "translate", "status", "file",
                    "progress", "download", "alternatives"]) {
    el[id] = document.getElementById(id);
  }
  Object.assign(el, {
    limitWarning: document.getElementById("limit-warning"),
    alternativesBox: document.getElementById("alternatives-box"),
    keyBox: document.getElementById("key-box"),
    apiKey: document.getElementById("api-key"),
    fileStatus: document.getElementById("file-status"),
  });
  el.form.addEventListener("submit", (event) => {
    event.preventDefault();
    translateNow();
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      translateNow();
    }
  });
  el.text.addEventListener("input", () => {
    updateCounter();
    scheduleTranslation();
  });
  el.nbest.addEventListener("input", scheduleTranslation);
  el.source.addEventListener("change", () => {
    fillTargets();
    translateNow();
  });
  el.target.addEventListener("change", () => {
    updateSwap();
    translateNow();
  });
  el.swap.addEventListener("click", swap);
  el.copy.addEventListener("click", copyTranslation);
  el.file.addEventListener("change", translateFile);
  updateCounter();
  try {
    const [languages, limits] = await Promise.all([callApi("languages"), callApi("v1/limits")]);
    state.limits = limits;
    el.keyBox.hidden = !limits.api_key_required;
    fillLanguages(languages);
    updateCounter();
  } catch (err) {
    showError(`Cannot load the server's languages: ${err.message}`, err.status);
  }
}

init();
