// Plays the speech API's audio in the page as it arrives: mp3 through Media Source Extensions into
// the <audio> element, wav and pcm through Web Audio (then into the <audio> element for replay);
// opus and flac, which a browser cannot play while they stream, once the whole file is in.

import { api } from "./api.js";

const LEAD_S = 0.05;
/** Web Audio: the first chunk starts this long after it arrived (scheduling headroom). */
const TYPES = { mp3: "audio/mpeg", opus: "audio/ogg", flac: "audio/flac", wav: "audio/wav", pcm: "audio/wav" };

export function mseSupported() {
  return typeof MediaSource !== "undefined" && MediaSource.isTypeSupported("audio/mpeg");
}

function once(target, event, signal) {
  return new Promise((resolve, reject) => {
    target.addEventListener(event, resolve, { once: true, signal });
    signal?.addEventListener("abort", () => reject(new DOMException("stopped", "AbortError")), { once: true });
  });
}

function concat(a, b) {
  if (!a.length) return b;
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

/** The sample rate and where the samples start, once the header is in; null until then. */
export function parseWavHeader(bytes) {
  if (bytes.length < 12) return null;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let offset = 12;
  let rate = null;
  while (offset + 8 <= bytes.length) {
    const id = String.fromCharCode(...bytes.subarray(offset, offset + 4));
    const size = view.getUint32(offset + 4, true);
    if (id === "data") return { rate, dataStart: offset + 8 };
    if (id === "fmt ") {
      if (offset + 16 > bytes.length) return null;
      rate = view.getUint32(offset + 12, true);
    }
    offset += 8 + size + (size % 2);
  }
  return null;
}

/** 16-bit mono WAV of Int16Array chunks. */
export function wavBlob(chunks, rate) {
  const samples = chunks.reduce((n, c) => n + c.length, 0);
  const header = new DataView(new ArrayBuffer(44));
  const text = (offset, s) => [...s].forEach((c, i) => header.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, 36 + samples * 2, true);
  text(8, "WAVE");
  text(12, "fmt ");
  header.setUint32(16, 16, true);
  header.setUint16(20, 1, true); // PCM
  header.setUint16(22, 1, true); // mono
  header.setUint32(24, rate, true);
  header.setUint32(28, rate * 2, true);
  header.setUint16(32, 2, true);
  header.setUint16(34, 16, true);
  text(36, "data");
  header.setUint32(40, samples * 2, true);
  return new Blob([header, ...chunks], { type: "audio/wav" });
}

export class StreamPlayer {
  constructor(audio) {
    this.audio = audio;
    this.context = null;
    this.nodes = new Set();
    this.controller = null;
    this.url = null;
  }

  /** Stop what is playing or loading. */
  stop() {
    this.controller?.abort();
    this.controller = null;
    for (const node of this.nodes) node.stop();
    this.nodes.clear();
    this.audio.pause();
  }

  setSource(blobOrSource) {
    if (this.url) URL.revokeObjectURL(this.url);
    this.url = URL.createObjectURL(blobOrSource);
    this.audio.src = this.url;
  }

  /** Play a recording (a Blob) in the <audio> element. */
  async playBlob(blob) {
    this.stop();
    this.setSource(blob);
    await this.audio.play();
  }

  /**
   * POST /v1/audio/speech with ``request`` and play the answer as it comes.
   * hooks.onStart(id) when the answer begins, hooks.onFirstAudio(ms since the click) when sound starts.
   * Resolves with {id, blob, bytes} once all of it is in; rejects with an AbortError when stopped.
   */
  async speak(request, { sampleRate = 24000, onStart = () => {}, onFirstAudio = () => {} } = {}) {
    this.stop();
    const controller = new AbortController();
    this.controller = controller;
    const signal = controller.signal;
    const started = performance.now();
    const firstAudio = () => onFirstAudio(performance.now() - started);
    const format = request.response_format;
    // A wav is sent whole unless asked for streamed: ask, so that it plays as it is made (the
    // replay and the download are rebuilt from its samples, with their real length).
    const body = format === "wav" && !request.stream_format ? { ...request, stream_format: "audio" } : request;
    const response = await api("/v1/audio/speech", { method: "POST", json: body, signal });
    const id = response.headers.get("X-Request-Id");
    onStart(id);
    const reader = response.body.getReader();
    signal.addEventListener("abort", () => reader.cancel().catch(() => {}), { once: true });
    let result;
    if (format === "mp3" && mseSupported()) result = await this.#playMse(reader, signal, firstAudio);
    else if (format === "pcm" || format === "wav") result = await this.#playPcm(reader, format, sampleRate, signal, started, onFirstAudio);
    else result = await this.#playWhole(reader, TYPES[format] || "application/octet-stream", signal, firstAudio);
    if (this.controller === controller) this.controller = null;
    return { id, ...result };
  }

  async #read(reader, signal) {
    const { value, done } = await reader.read();
    if (signal.aborted) throw new DOMException("stopped", "AbortError");
    return done ? null : value;
  }

  async #playMse(reader, signal, firstAudio) {
    const audio = this.audio;
    const source = new MediaSource();
    this.setSource(source);
    await once(source, "sourceopen", signal);
    const buffer = source.addSourceBuffer("audio/mpeg");
    buffer.mode = "sequence";
    audio.addEventListener("playing", firstAudio, { once: true, signal });
    const chunks = [];
    let bytes = 0;
    let value;
    while ((value = await this.#read(reader, signal)) !== null) {
      chunks.push(value);
      bytes += value.length;
      buffer.appendBuffer(value);
      await once(buffer, "updateend", signal);
      if (chunks.length === 1) audio.play().catch(() => {}); // refused without a user's click
    }
    if (source.readyState === "open") source.endOfStream();
    return { blob: new Blob(chunks, { type: "audio/mpeg" }), bytes };
  }

  #audioContext() {
    if (!this.context) this.context = new AudioContext();
    return this.context;
  }

  async #playPcm(reader, format, sampleRate, signal, started, onFirstAudio) {
    const context = this.#audioContext();
    await context.resume();
    let rate = sampleRate;
    let header = format === "wav";
    let pending = new Uint8Array(0);
    const pcm = [];
    let at = 0;
    let bytes = 0;
    let value;
    while ((value = await this.#read(reader, signal)) !== null) {
      bytes += value.length;
      pending = concat(pending, value);
      if (header) {
        const parsed = parseWavHeader(pending);
        if (!parsed) continue;
        rate = parsed.rate || rate;
        pending = pending.slice(parsed.dataStart);
        header = false;
      }
      const usable = pending.length - (pending.length % 2);
      if (!usable) continue;
      const samples = new Int16Array(pending.slice(0, usable).buffer);
      pending = pending.slice(usable);
      pcm.push(samples);
      const floats = Float32Array.from(samples, (s) => s / 32768);
      const buffer = context.createBuffer(1, floats.length, rate);
      buffer.copyToChannel(floats, 0);
      const node = context.createBufferSource();
      node.buffer = buffer;
      node.connect(context.destination);
      const first = at === 0;
      at = Math.max(at, context.currentTime + LEAD_S);
      node.start(at);
      if (first) onFirstAudio(performance.now() - started + (at - context.currentTime) * 1000);
      at += buffer.duration;
      this.nodes.add(node);
      node.addEventListener("ended", () => this.nodes.delete(node));
    }
    const blob = wavBlob(pcm, rate);
    this.setSource(blob); // heard already through Web Audio: kept in the element to replay
    return { blob, bytes };
  }

  async #playWhole(reader, type, signal, firstAudio) {
    const chunks = [];
    let bytes = 0;
    let value;
    while ((value = await this.#read(reader, signal)) !== null) {
      chunks.push(value);
      bytes += value.length;
    }
    const blob = new Blob(chunks, { type });
    this.setSource(blob);
    this.audio.addEventListener("playing", firstAudio, { once: true, signal });
    await this.audio.play().catch(() => {});
    return { blob, bytes };
  }
}
