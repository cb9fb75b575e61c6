// s2s-daemon's web page: voices (list, play, clone from a file or the microphone, design, rename,
// remove), "try it" (streamed into this browser or spoken on the daemon's speaker) and a live view
// fed by the daemon's own events (GET /api/events, Server-Sent Events).

import { ApiError, AuthError, api, apiJson, apiKey, readEvents, setApiKey } from "./api.js";
import { StreamPlayer } from "./player.js";
import { drawPlot } from "./plot.js";
import { MicRecorder, canRecord } from "./recorder.js";

const $ = (id) => document.getElementById(id);
const player = new StreamPlayer($("player"));
const FORMATS = ["mp3", "wav", "pcm", "opus", "flac"];
const LATENCY_SHOWN = 50;
const MEMORY_WINDOW_MS = 10 * 60 * 1000;
const RECENT_ROWS = 15;

const page = {
  snapshot: null,
  voices: null,
  editing: false, // a rename being typed or a removal to confirm: the list is not redrawn under it
  status: { state: "unknown", queue: 0, currentId: null },
  jobs: [],
  latency: [],
  memory: [],
  recent: new Map(), // id -> {origin, status, latency}
  watchers: new Map(), // id -> {latency(payload), finished(payload)}
  liveController: null,
};

// -- small helpers ---------------------------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function show(node, text, kind) {
  node.textContent = text;
  node.hidden = !text;
  if (kind) node.className = `result ${kind}`;
}

function ms(value) {
  return value === null || value === undefined ? "–" : `${Math.round(value)} ms`;
}

function fixed(value, digits = 2) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function sleep(millis) {
  return new Promise((resolve) => setTimeout(resolve, millis));
}

function notice(text) {
  show($("notice"), text);
}

/** Show an error where it belongs; a missing or wrong key opens the login form. */
function failed(error, target) {
  if (error instanceof AuthError) {
    showLogin(apiKey() ? "The daemon refused this key." : "");
    return;
  }
  if (error.name === "AbortError") return;
  const text = error instanceof ApiError ? error.message : `${error.message || error}`;
  if (target) show(target, text, "bad");
  else notice(text);
}

function sampleText(voice) {
  return `Hello! This is the voice ${voice}, speaking from your speech daemon.`;
}

// -- tabs and login --------------------------------------------------------------------------

function selectTab(name) {
  for (const button of document.querySelectorAll("nav [role=tab]")) {
    const selected = button.dataset.tab === name;
    button.setAttribute("aria-selected", String(selected));
    $(`tab-${button.dataset.tab}`).hidden = !selected;
  }
  if (name === "live") drawPlots();
  else if (page.voices) loadVoices(); // voices added elsewhere (voices add, another page) show up
  history.replaceState(null, "", `#${name}`);
}

function showLogin(message) {
  $("login").hidden = false;
  show($("login-error"), message || "");
  $("login-error").className = "error";
  $("login-key").focus();
}

function signedIn() {
  $("login").hidden = true;
  $("key-button").hidden = !apiKey();
  loadVoices();
  connectLive();
}

// -- the live view ---------------------------------------------------------------------------

async function connectLive() {
  page.liveController?.abort();
  const controller = new AbortController();
  page.liveController = controller;
  let delay = 1000;
  while (!controller.signal.aborted) {
    try {
      await readEvents("/api/events", onEvent, controller.signal);
      delay = 1000;
    } catch (error) {
      if (controller.signal.aborted) return;
      if (error instanceof AuthError) {
        setConnection("needs the API key");
        failed(error);
        return;
      }
    }
    setConnection("reconnecting");
    setStatus({ state: "offline", queue: 0, currentId: null });
    await sleep(delay);
    delay = Math.min(delay * 2, 10000);
  }
}

function setConnection(text) {
  $("live-connection").textContent = text ? `· ${text}` : "";
}

function onEvent(kind, payload) {
  switch (kind) {
    case "snapshot":
      page.snapshot = payload;
      page.latency = payload.history.latency;
      page.memory = payload.history.memory;
      for (const event of page.latency) remember(event.id, { latency: event });
      setConnection("live");
      if (!page.voices) loadVoices(); // the first answer after the daemon came (back)
      renderEngine();
      fillTryChoices();
      setStatus(payload.state);
      setJobs(payload.jobs);
      drawPlots();
      renderRecent();
      break;
    case "state":
      setStatus(payload);
      break;
    case "jobs":
      setJobs(payload.jobs);
      break;
    case "finished":
      remember(payload.id, { status: payload.status });
      page.watchers.get(payload.id)?.finished?.(payload);
      renderRecent();
      break;
    case "latency":
      page.latency.push(payload);
      page.latency.splice(0, Math.max(0, page.latency.length - 200));
      remember(payload.id, { latency: payload });
      page.watchers.get(payload.id)?.latency?.(payload);
      drawPlots();
      renderRecent();
      break;
    case "memory":
      page.memory.push(payload);
      while (page.memory.length && page.memory[0].ts < Date.now() - MEMORY_WINDOW_MS) page.memory.shift();
      drawPlots();
      break;
    case "info":
      if (page.voices) loadVoices(); // the library may have changed
      break;
    default:
      break;
  }
}

function remember(id, fields) {
  const row = page.recent.get(id) || { origin: null, status: null, latency: null };
  Object.assign(row, fields);
  page.recent.delete(id);
  page.recent.set(id, row); // latest last
  while (page.recent.size > 100) page.recent.delete(page.recent.keys().next().value);
}

function setStatus(status) {
  page.status = status;
  $("live-stop").disabled = status.state !== "speaking" && status.state !== "synthesizing";
  for (const badge of [$("state-badge"), $("live-state")]) {
    badge.dataset.state = status.state;
    badge.textContent = status.state;
  }
  $("live-queue").textContent = `queue: ${status.queue}`;
}

function describeJob(job) {
  const where = job.output === "speaker" ? "speaker" : "its caller";
  return `${job.phase} · from ${job.origin} · to ${where} · voice ${job.voice || "default"} · ${job.language}`;
}

function setJobs(jobs) {
  page.jobs = jobs;
  for (const job of jobs) remember(job.id, { origin: job.origin });
  const current = jobs.find((job) => job.id === page.status.currentId) || jobs.find((job) => job.phase !== "queued");
  const box = $("live-current");
  box.replaceChildren();
  if (current) {
    box.append(
      el("div", { class: "muted" }, `${current.id} · ${describeJob(current)} · ${(current.ageMs / 1000).toFixed(1)} s`),
      el("div", {}, `“${current.text}”`),
    );
  } else {
    box.append(el("span", { class: "muted" }, "Nothing in hand."));
  }
  $("live-jobs").replaceChildren(
    ...jobs.map((job) => el("li", { dataset: { id: job.id } }, `${describeJob(job)}: “${job.text}”`)),
  );
  renderRecent();
}

function renderEngine() {
  const snap = page.snapshot;
  if (!snap) return;
  const engine = snap.engine;
  const machine = snap.machine;
  $("engine-line").textContent = `${engine.engine} · ${engine.model.split("/").pop()} · ${engine.dtype || "?"} · ${engine.device}`;
  const facts = [
    ["Engine", engine.engine],
    ["Model", engine.model],
    ["Kind", engine.mode],
    ["Weights", engine.dtype || "–"],
    ["Device", engine.device],
    ["Sample rate", `${engine.sampleRate} Hz`],
    ["Daemon", `${snap.version} · site ${snap.siteId}`],
    // null: the daemon shows its machine only to callers with the key, or on the machine itself
    ...(machine
      ? [
          ["Machine", `${machine.hostname} · ${machine.system} · ${machine.arch}`],
          ["CPU", `${machine.cpu} · ${machine.cores} cores`],
          ["Memory", `${Math.round(machine.memory_mib / 1024)} GiB`],
          ["Python", machine.python],
        ]
      : [["Machine", "not shown to other machines without an API key"]]),
  ];
  $("live-engine").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

function drawPlots() {
  if ($("tab-live").hidden) return;
  const shown = page.latency.slice(-LATENCY_SHOWN);
  const first = page.latency.length - shown.length + 1;
  const indexed = (key) => shown.map((e, i) => [first + i, e[key]]).filter((p) => typeof p[1] === "number");
  drawPlot($("plot-ttfa"), {
    series: [
      { label: "first chunk (engine)", color: "#2364d2", points: indexed("ttfaMs") },
      { label: "first audio out", color: "#1c8a4a", points: indexed("firstAudioOutMs") },
    ],
    yMax: 0,
    xLabel: (x) => `#${Math.round(x)}`,
    empty: "no request yet",
  });
  drawPlot($("plot-rtf"), {
    series: [{ label: "real-time factor", color: "#b26a00", points: indexed("rtf") }],
    reference: { y: 1, label: "real time" },
    xLabel: (x) => `#${Math.round(x)}`,
    empty: "no request yet",
  });
  const now = Date.now();
  const memory = page.memory.filter((e) => e.ts >= now - MEMORY_WINDOW_MS);
  const series = [{ label: "RSS", color: "#2364d2", points: memory.map((e) => [(e.ts - now) / 1000, e.rssMiB]) }];
  if (memory.some((e) => e.deviceKind && e.deviceKind !== "none")) {
    series.push({
      label: `${memory[memory.length - 1].deviceKind} allocated`,
      color: "#c0362c",
      points: memory.map((e) => [(e.ts - now) / 1000, e.deviceAllocatedMiB]),
    });
  }
  // The whole window once it is full; until then, what there is (at least a minute).
  const oldest = memory.length ? (memory[0].ts - now) / 1000 : -60;
  drawPlot($("plot-memory"), {
    series,
    xMin: Math.min(-60, Math.max(-MEMORY_WINDOW_MS / 1000, oldest)),
    xMax: 0,
    xLabel: (x) => (x > -1 ? "now" : x > -90 ? `${Math.round(-x)} s ago` : `${Math.round(-x / 60)} min ago`),
    empty: "no memory event yet (telemetry.memory_interval_s)",
  });
}

function renderRecent() {
  const rows = [...page.recent.entries()].filter(([, row]) => row.status || row.latency).slice(-RECENT_ROWS).reverse();
  $("live-recent").tBodies[0].replaceChildren(
    ...rows.map(([id, row]) => {
      const lat = row.latency || {};
      return el(
        "tr",
        { dataset: { id } },
        el("td", { title: id }, id.length > 12 ? `${id.slice(0, 12)}…` : id),
        el("td", {}, row.origin || "–"),
        el("td", {}, row.status || "…"),
        el("td", { class: "num" }, ms(lat.firstAudioOutMs)),
        el("td", { class: "num" }, fixed(lat.rtf)),
        el("td", { class: "num" }, lat.audioMs !== undefined ? `${(lat.audioMs / 1000).toFixed(1)} s` : "–"),
      );
    }),
  );
}

// -- voices ----------------------------------------------------------------------------------

async function loadVoices() {
  let waited = false;
  for (;;) {
    try {
      page.voices = await apiJson("/api/voices");
      break;
    } catch (error) {
      if (!(error instanceof ApiError && error.code === "model_loading")) {
        failed(error);
        return;
      }
      notice("The daemon is loading its model; the page fills in when it is ready.");
      waited = true;
      await sleep(2000);
    }
  }
  if (waited) notice("");
  if (!page.editing) renderVoices(); // not under a name being typed or a removal to confirm
  fillTryChoices();
}

/** A voice's rename or removal in progress (true) or over (false): the list waits for it. */
function editing(busy) {
  page.editing = busy;
  if (!busy && page.voices) renderVoices();
}

function renderVoices() {
  const data = page.voices;
  const speaks = data.can_clone ? "cloned voices" : data.can_design ? "designed voices" : "its preset voices only";
  $("voices-summary").textContent = `This ${data.mode} model speaks ${speaks}. Library: ${data.folder}`;
  $("voice-list").replaceChildren(...data.voices.map(voiceItem));
  const clone = $("clone-note");
  show(clone, data.can_clone ? "" : `This ${data.mode} model cannot clone: a voice added here is kept in the library for a Base model.`);
  clone.className = "note";
  const design = $("design-note");
  show(design, data.can_design ? "" : `This ${data.mode} model cannot speak designed voices: they need a VoiceDesign model.`);
  design.className = "note";
  $("design-try").disabled = !data.can_design;
  for (const id of ["clone-language", "design-language"]) fillSelect($(id), data.languages, "auto");
}

function voiceItem(voice) {
  const meta = [];
  if (voice.unreadable) meta.push("unreadable folder");
  if (voice.seconds) meta.push(`${voice.seconds.toFixed(1)} s`);
  if (voice.kind === "clone") meta.push(voice.transcript ? "with transcript" : "no transcript");
  if (voice.instruct) meta.push(`“${voice.instruct}”`);
  if (voice.language) meta.push(voice.language);
  if (voice.description) meta.push(voice.description);
  if (!voice.speakable) meta.push("this model cannot speak it");
  if (page.voices && voice.name === page.voices.default) meta.push("default");
  const library = voice.kind !== "preset";
  const actions = el("span", { class: "voice-actions" });
  actions.append(
    el("button", {
      type: "button", class: "small", "data-action": "play", disabled: !voice.speakable,
      title: voice.speakable ? "Speak a sample in this browser" : "this model cannot speak it",
      onclick: () => playSample(voice.name),
    }, "▶ Play"),
  );
  if (voice.kind === "clone") {
    actions.append(el("button", { type: "button", class: "small", "data-action": "reference", onclick: () => playReference(voice.name) }, "Recording"));
  }
  if (library) {
    actions.append(
      el("button", { type: "button", class: "small", "data-action": "rename", onclick: () => startRename(item, voice.name) }, "Rename"),
      removeButton(voice.name),
    );
  }
  const item = el(
    "li",
    { class: voice.speakable ? "" : "unspeakable", dataset: { voice: voice.name } },
    el("span", { class: "voice-name" }, voice.name),
    el("span", { class: "kind badge" }, voice.kind || "?"),
    el("span", { class: "voice-meta" }, meta.join(" · ")),
    actions,
  );
  return item;
}

function removeButton(name) {
  let armed = null;
  const button = el("button", { type: "button", class: "small danger", "data-action": "remove" }, "Remove");
  button.addEventListener("click", async () => {
    if (!armed) {
      page.editing = true;
      button.classList.add("armed");
      button.textContent = "Really remove?";
      armed = setTimeout(() => editing(false), 5000);
      return;
    }
    clearTimeout(armed);
    try {
      await api(`/api/voices/${encodeURIComponent(name)}`, { method: "DELETE" });
      notice("");
    } catch (error) {
      failed(error);
    }
    page.editing = false;
    loadVoices();
  });
  return button;
}

function startRename(item, name) {
  const input = el("input", { value: name, "aria-label": `New name for ${name}`, maxlength: 64 });
  const save = async () => {
    try {
      await api(`/api/voices/${encodeURIComponent(name)}`, { method: "PATCH", json: { name: input.value.trim() } });
      notice("");
      page.editing = false;
      loadVoices();
    } catch (error) {
      failed(error); // the field stays for another try
    }
  };
  page.editing = true;
  const actions = item.querySelector(".voice-actions");
  actions.replaceChildren(
    input,
    el("button", { type: "button", class: "small", "data-action": "save", onclick: save }, "Save"),
    el("button", { type: "button", class: "small secondary", onclick: () => editing(false) }, "Cancel"),
  );
  input.addEventListener("keydown", (event) => event.key === "Enter" && save());
  input.focus();
}

function setPlayerLabel(text) {
  $("player-label").textContent = text;
}

function offerDownload(blob, name) {
  const link = $("player-download");
  if (link.href) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.hidden = false;
}

async function playSample(name) {
  setPlayerLabel(`${name}: …`);
  try {
    const result = await player.speak(
      { model: "s2s", input: sampleText(name), voice: name, response_format: "mp3" },
      {
        sampleRate: page.snapshot?.engine.sampleRate,
        onFirstAudio: (millis) => setPlayerLabel(`${name}: first audio after ${Math.round(millis)} ms`),
      },
    );
    offerDownload(result.blob, `${name}.mp3`);
  } catch (error) {
    setPlayerLabel(`${name}: ${error.name === "AbortError" ? "stopped" : "failed"}`);
    failed(error);
  }
}

async function playReference(name) {
  try {
    const blob = await (await api(`/api/voices/${encodeURIComponent(name)}/reference`)).blob();
    setPlayerLabel(`${name}: its reference recording`);
    await player.playBlob(blob);
  } catch (error) {
    failed(error);
  }
}

// -- adding voices ---------------------------------------------------------------------------

const clone = { audio: null, filename: null, recorder: null };

function setCloneAudio(blob, filename) {
  show($("clone-result"), "");
  clone.audio = blob;
  clone.filename = filename;
  const preview = $("clone-preview");
  if (preview.src) URL.revokeObjectURL(preview.src);
  preview.src = URL.createObjectURL(blob);
  preview.hidden = false;
  checkCloneAudio();
}

function cloneForm(extra) {
  const form = new FormData();
  form.append("audio", clone.audio, clone.filename);
  if ($("clone-force").checked) form.append("force", "true");
  for (const [key, value] of Object.entries(extra)) if (value) form.append(key, value);
  return form;
}

async function checkCloneAudio() {
  const box = $("clone-checks");
  box.hidden = false;
  box.replaceChildren(el("span", { class: "muted" }, "Checking the recording…"));
  try {
    const answer = await apiJson("/api/voices", { method: "POST", body: cloneForm({ dry_run: "true" }) }).catch(
      (error) => {
        if (error instanceof ApiError && error.status === 422 && error.body && error.body.checks) return error.body;
        throw error; // a recording the checks refuse is 422, with its checks beside the error
      },
    );
    const c = answer.checks;
    const level = c.rms > 0 ? `${(20 * Math.log10(c.rms)).toFixed(0)} dBFS RMS` : "silent";
    const items = [
      el("li", { class: c.seconds >= 3 && c.seconds <= 30 ? "" : "error" }, `length ${c.seconds.toFixed(1)} s (3 to 30 s)`),
      el("li", {}, `level ${level}`),
      el("li", {}, c.clipped_share > 0 ? `${(c.clipped_share * 100).toFixed(2)} % of samples at full scale` : "no clipping"),
      ...answer.warnings.map((w) => el("li", { class: "note" }, w)),
    ];
    if (answer.error) items.push(el("li", { class: "error" }, answer.error.message));
    box.replaceChildren(el("strong", {}, answer.error ? "Not usable as it is:" : "Checks:"), el("ul", {}, items));
  } catch (error) {
    box.replaceChildren(el("span", { class: "error" }, error.message));
    failed(error, null);
  }
}

async function toggleRecording() {
  const button = $("record-button");
  if (clone.recorder) {
    const recorder = clone.recorder;
    clone.recorder = null;
    button.textContent = "Record";
    button.classList.remove("recording");
    const { blob } = await recorder.stop();
    $("record-level").value = 0;
    $("clone-file").value = "";
    setCloneAudio(blob, "recording.wav");
    return;
  }
  const recorder = new MicRecorder(
    (seconds, level) => {
      $("record-time").textContent = `${seconds.toFixed(1)} s`;
      $("record-level").value = level;
    },
    () => clone.recorder === recorder && toggleRecording(),
  );
  try {
    await recorder.start();
  } catch (error) {
    show($("record-note"), `The microphone is not available: ${error.message}`);
    return;
  }
  clone.recorder = recorder;
  button.textContent = "Stop";
  button.classList.add("recording");
}

async function submitClone(event) {
  event.preventDefault();
  const result = $("clone-result");
  if (!clone.audio) {
    show(result, "Choose a file or record one first.", "bad");
    return;
  }
  const form = cloneForm({
    name: $("clone-name").value.trim(),
    ref_text: $("clone-text").value.trim(),
    language: $("clone-language").value === "auto" ? "" : $("clone-language").value,
    description: $("clone-description").value.trim(),
  });
  try {
    const answer = await apiJson("/api/voices", { method: "POST", body: form });
    const warnings = answer.warnings.length ? ` (${answer.warnings.join("; ")})` : "";
    show(result, `Added ${answer.voice.name}${warnings}.`, "ok");
    $("clone-form").reset();
    $("clone-preview").hidden = true;
    $("clone-checks").hidden = true;
    clone.audio = null;
    loadVoices();
  } catch (error) {
    failed(error, result);
  }
}

function designFields() {
  const language = $("design-language").value;
  return {
    name: $("design-name").value.trim(),
    instruct: $("design-instruct").value.trim(),
    language: language === "auto" ? null : language,
    description: $("design-description").value.trim() || null,
    force: $("design-force").checked,
  };
}

async function submitDesign(event) {
  event.preventDefault();
  const result = $("design-result");
  try {
    const answer = await apiJson("/api/voices", { method: "POST", json: designFields() });
    const warnings = answer.warnings.length ? ` (${answer.warnings.join("; ")})` : "";
    show(result, `Added ${answer.voice.name}${warnings}.`, "ok");
    $("design-form").reset();
    loadVoices();
  } catch (error) {
    failed(error, result);
  }
}

async function tryDesign() {
  const fields = designFields();
  if (!fields.instruct) {
    show($("design-result"), "Write the instruction first.", "bad");
    return;
  }
  setPlayerLabel("designed voice: …");
  try {
    await player.speak(
      { model: "s2s", input: sampleText("you described"), instructions: fields.instruct, language: fields.language, response_format: "mp3" },
      { onFirstAudio: (millis) => setPlayerLabel(`designed voice: first audio after ${Math.round(millis)} ms`) },
    );
  } catch (error) {
    failed(error, $("design-result"));
  }
}

// -- try it ----------------------------------------------------------------------------------

function fillSelect(select, values, selected, labels = {}) {
  const keep = select.value || selected;
  select.replaceChildren(...values.map((v) => el("option", { value: v }, labels[v] || v || "(default)")));
  if (values.includes(keep)) select.value = keep;
}

function fillTryChoices() {
  if (page.voices) {
    const speakable = page.voices.voices.filter((v) => v.speakable).map((v) => v.name);
    const fallback = page.voices.default ? `default (${page.voices.default})` : "default";
    fillSelect($("try-voice"), ["", ...speakable], page.voices.default || "", { "": fallback });
    fillSelect($("try-language"), page.voices.languages, "auto");
  }
  fillSelect($("try-format"), page.snapshot?.formats || FORMATS, "mp3");
}

const trying = { speakerId: null };

function setStats(entries) {
  $("try-stats").replaceChildren(
    ...entries.flatMap(([key, label, value]) => [el("dt", {}, label), el("dd", { dataset: { stat: key } }, value)]),
  );
}

function updateStat(key, value) {
  const dd = $("try-stats").querySelector(`[data-stat="${key}"]`);
  if (dd) dd.textContent = value;
}

function watch(id) {
  const latency = (event) => {
    updateStat("engine-first", ms(event.ttfaMs));
    updateStat("first-out", ms(event.firstAudioOutMs));
    updateStat("rtf", fixed(event.rtf));
    updateStat("audio", `${(event.audioMs / 1000).toFixed(2)} s in ${event.chunks} chunks`);
  };
  const finished = (event) => {
    updateStat("status", event.error ? `${event.status}: ${event.error.message}` : event.status);
    if (trying.speakerId === id) trying.speakerId = null;
  };
  page.watchers.clear();
  page.watchers.set(id, { latency, finished });
  const known = page.recent.get(id);
  if (known?.latency) latency(known.latency);
  if (known?.status) finished({ status: known.status });
}

/** What the daemon's text stage makes of ``text`` (POST /api/text), shown under Try it. */
async function showSpoken(text, language) {
  $("try-spoken").hidden = true;
  try {
    const answer = await apiJson("/api/text", { method: "POST", json: { text, language } });
    $("try-spoken-text").textContent = answer.spoken || "(nothing: a say of it is refused empty_text)";
    $("try-spoken-note").textContent = answer.changed ? "(prepared by the text stage)" : "(as written)";
    $("try-spoken").hidden = false;
  } catch (error) {
    // The request itself says what is wrong with the text (try-error); nothing to show here.
    if (error instanceof AuthError) failed(error, $("try-error"));
  }
}

async function speak(event) {
  event.preventDefault();
  show($("try-error"), "");
  const text = $("try-text").value;
  const voice = $("try-voice").value || null;
  const language = $("try-language").value || null;
  const instruct = $("try-instruct").value.trim() || null;
  showSpoken(text, language); // beside the speech, not before it
  setStats([
    ["id", "Request", "…"],
    ["status", "Status", "sent"],
    ["first-audio", "First audio here", "–"],
    ["engine-first", "First chunk (daemon)", "–"],
    ["first-out", "First audio out (daemon)", "–"],
    ["rtf", "Real-time factor", "–"],
    ["audio", "Audio", "–"],
  ]);
  if ($("try-speaker").checked) {
    updateStat("first-audio", "on the speaker");
    try {
      const answer = await apiJson("/api/say", { method: "POST", json: { text, voice, language, instruct } });
      trying.speakerId = answer.id;
      updateStat("id", answer.id);
      updateStat("status", "queued on the daemon's speaker");
      watch(answer.id);
    } catch (error) {
      updateStat("status", "refused");
      failed(error, $("try-error"));
    }
    return;
  }
  const format = $("try-format").value || "mp3";
  const request = { model: "s2s", input: text, voice, language, instructions: instruct, response_format: format };
  setPlayerLabel("try it: …");
  try {
    const result = await player.speak(request, {
      sampleRate: page.snapshot?.engine.sampleRate,
      onStart: (id) => {
        updateStat("id", id);
        updateStat("status", "streaming");
        watch(id);
      },
      onFirstAudio: (millis) => {
        updateStat("first-audio", ms(millis));
        setPlayerLabel(`try it: first audio after ${Math.round(millis)} ms`);
      },
    });
    updateStat("status", "received");
    offerDownload(result.blob, `speech.${format === "pcm" ? "wav" : format}`);
  } catch (error) {
    updateStat("status", error.name === "AbortError" ? "stopped" : "failed");
    failed(error, $("try-error"));
  }
}

async function stopSpeaking() {
  player.stop();
  const id = trying.speakerId;
  if (id) {
    try {
      await api("/api/stop", { method: "POST", json: { id } });
    } catch (error) {
      failed(error, $("try-error"));
    }
  }
}

// -- start -----------------------------------------------------------------------------------

async function start() {
  for (const button of document.querySelectorAll("nav [role=tab]")) {
    button.addEventListener("click", () => selectTab(button.dataset.tab));
  }
  const tab = location.hash.slice(1);
  selectTab(["voices", "try", "live"].includes(tab) ? tab : "voices");
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey($("login-key").value.trim());
    $("login-key").value = "";
    signedIn();
  });
  $("key-button").addEventListener("click", () => {
    setApiKey("");
    page.liveController?.abort();
    showLogin("");
    $("key-button").hidden = true;
  });
  $("clone-file").addEventListener("change", (event) => {
    const file = event.target.files[0];
    if (file) setCloneAudio(file, file.name);
  });
  if (canRecord()) {
    $("record-button").addEventListener("click", toggleRecording);
  } else {
    $("record-button").disabled = true;
    show($("record-note"), "Recording needs a secure page (https, or http://localhost): choose a file instead.");
  }
  $("clone-form").addEventListener("submit", submitClone);
  $("design-form").addEventListener("submit", submitDesign);
  $("design-try").addEventListener("click", tryDesign);
  $("try-form").addEventListener("submit", speak);
  $("try-stop").addEventListener("click", stopSpeaking);
  $("live-stop").addEventListener("click", async () => {
    try {
      await api("/api/stop", { method: "POST", json: {} });
    } catch (error) {
      failed(error);
    }
  });
  window.addEventListener("resize", drawPlots);
  fillTryChoices();
  let auth = { key_required: false };
  try {
    auth = await (await fetch("/api/auth", { cache: "no-store" })).json();
  } catch (error) {
    notice(`The daemon does not answer: ${error.message}`);
  }
  if (auth.key_required && !apiKey()) showLogin("");
  else signedIn();
}

start();
