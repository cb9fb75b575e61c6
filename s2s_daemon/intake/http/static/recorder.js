// Records the microphone as 16-bit mono WAV at the device's rate (the daemon resamples), through an
// AudioWorklet: a file the daemon's libsndfile reads, unlike MediaRecorder's WebM or MP4.

import { wavBlob } from "./player.js";

export const MAX_S = 30;

export function canRecord() {
  return Boolean(window.isSecureContext && navigator.mediaDevices && window.AudioWorkletNode);
}

export class MicRecorder {
  /** onProgress(seconds, level 0..1) while recording; stops by itself after MAX_S. */
  constructor(onProgress, onAutoStop) {
    this.onProgress = onProgress;
    this.onAutoStop = onAutoStop;
    this.context = null;
    this.stream = null;
    this.chunks = [];
    this.samples = 0;
  }

  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
    });
    this.context = new AudioContext();
    await this.context.audioWorklet.addModule("/static/recorder-worklet.js");
    const source = this.context.createMediaStreamSource(this.stream);
    const node = new AudioWorkletNode(this.context, "pcm-recorder");
    const rate = this.context.sampleRate;
    node.port.onmessage = (event) => {
      const block = event.data;
      this.chunks.push(block);
      this.samples += block.length;
      let peak = 0;
      for (const s of block) peak = Math.max(peak, Math.abs(s));
      this.onProgress(this.samples / rate, peak);
      if (this.samples / rate >= MAX_S) this.onAutoStop();
    };
    source.connect(node);
    node.connect(this.context.destination); // pulled by the graph; it outputs silence
  }

  /** Stop; resolves with {blob, seconds}. */
  async stop() {
    const rate = this.context ? this.context.sampleRate : 48000;
    this.stream?.getTracks().forEach((track) => track.stop());
    await this.context?.close();
    const pcm = this.chunks.map((block) => Int16Array.from(block, (s) => Math.max(-32768, Math.min(32767, Math.round(s * 32767)))));
    const seconds = this.samples / rate;
    this.chunks = [];
    this.samples = 0;
    return { blob: wavBlob(pcm, rate), seconds };
  }
}
