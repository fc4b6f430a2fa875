// arstream demo page: one WebSocket session (protocol v1, docs/PROTOCOL.md) played through
// Media Source Extensions. Plain ES module, no dependencies, no build step.

import { InputPanel } from "./input.js";
import { PeerTransport, SocketTransport } from "./transports.js";

const KEEP_BEHIND_S = 30;     // media kept behind the playhead; older ranges are removed
const TRIM_STEP_S = 5;        // remove in steps, not after every segment
// The server sends each piece of media shortly before it plays (its playout margin, docs/PROTOCOL.md): the
// page plays near the live edge so that what you change is on screen as soon as the server made it. Behind
// the edge by more than LIVE_EDGE_S (a stall, a slow start), it plays a little faster until it is back.
const LIVE_EDGE_S = 0.6;
const CATCH_UP_RATE = 1.15;
const MAX_LAG_S = 3;          // further than this behind the live edge: jump forward
const CONTROL_KEEP = 20;      // control-to-screen figures kept for the median
const CAMERA_KEEP = 40;       // camera-to-screen figures kept for the median (one per live chunk)
const CAMERA_EXPORT_KEEP = 600; // ... and for window.arstreamDemo (tests, benchmarks)
const FPS_WINDOW_MS = 4000;   // sliding window of the fps readout
const STALL_MS = 3000;        // no chunk for this long (or 2 usual gaps): fps reads 0
const LATENCY_KEEP = 30;      // chunks in the latency median
const LOG_MAX = 80;
// Shown in the empty prompt box; Start with the box left empty generates it (and puts it in the box).
// One the built-in tiny model can show (its caption grammar); any model reads it.
const EXAMPLE_PROMPT = "a green triangle orbiting on a black background";

const $ = (id) => document.getElementById(id);
const ui = {
  video: $("video"), prompt: $("prompt"), seed: $("seed"), policy: $("policy"),
  start: $("start"), pause: $("pause"), apply: $("apply"), reset: $("reset"), close: $("close"), mute: $("mute"),
  state: $("state"), mediaInfo: $("media-info"), log: $("log"), notice: $("notice"),
  fps: $("fps"), ttfc: $("ttfc"), chunks: $("chunks"), latency: $("latency"), server: $("server"),
  buffer: $("buffer"), decoded: $("decoded"), errors: $("errors"), toScreen: $("to-screen"),
  cameraToScreen: $("camera-to-screen"),
  transport: $("transport"), transportInUse: $("transport-in-use"),
};
// Pictures and video in: the picker and the camera (input.js).
const input = new InputPanel({
  file: $("media"), clearFile: $("clear-media"), camera: $("camera"), strength: $("strength"),
  strengthText: $("strength-text"), inputView: $("input-view"), inputImage: $("input-image"),
  inputVideo: $("input-video"), inputInfo: $("input-info"),
}, (kind, text) => log(kind, text));

let current = null;  // the Session shown on the page
let errorCount = 0;  // problems of the current session (reset when a new one starts)

// kind: "error" (counted: a server error, a refused append, a lost connection), "hint" (a mistake in
// the form, not counted), "ack", "state", "info".
function log(kind, text) {
  const li = document.createElement("li");
  li.className = kind;
  li.dataset.kind = kind;
  const time = new Date().toLocaleTimeString([], { hour12: false });
  li.textContent = `${time}  ${text}`;
  ui.log.prepend(li);
  while (ui.log.children.length > LOG_MAX) ui.log.lastChild.remove();
  if (kind === "error") ui.errors.textContent = String(++errorCount);
}

function notice(text) {
  ui.notice.textContent = text || "";
  ui.notice.hidden = !text;
}

const short = (text, n = 40) => (text.length > n ? `${text.slice(0, n - 1)}…` : text);
const median = (xs) => { const s = [...xs].sort((a, b) => a - b); return s[Math.floor(s.length / 2)]; };

class Session {
  constructor(startFields, transportChoice) {
    this.startFields = startFields;  // sent as `start` once the session is announced
    this.state = "connecting";
    this.sessionId = null;
    this.mime = null;
    this.ms = null;                  // MediaSource
    this.sb = null;                  // SourceBuffer
    this.queue = [];                 // ArrayBuffers waiting for the SourceBuffer
    this.ending = false;             // end the MediaSource once the queue is drained
    this.expect = null;              // what the next binary message is: "init" | "media"
    this.pendingChunk = null;        // the `chunk` message whose segment comes next
    this.sent = new Map();           // message id -> description, for the ack log
    this.seq = 0;
    this.startClick = performance.now();
    this.firstChunkMs = null;
    this.chunks = 0;
    this.arrivals = [];              // {t, frames} of recent chunks, for fps
    this.latencies = [];
    this.timings = null;
    this.lastError = null;           // the last `error` message, to explain a `closed` that follows it
    this.frameSize = null;           // {width, height} of the session's video (live input is sent at this size)
    this.fps = null;
    this.controlsSent = new Map();   // id of a prompt change / reset / live change -> performance.now() at send
    this.controlsDue = [];           // {id, sentAt, namedAt, pts}: named by a chunk, waiting to be on screen
    this.toScreen = [];              // ms from sending a control to its first frame shown
    this.cameraDue = [];             // {number, capturedAt, pts}: a chunk made from that camera frame, not yet shown
    this.cameraToScreen = [];        // ms from capturing a camera frame to the first frame shown made from it

    this.transport = null;           // SocketTransport or PeerTransport (transports.js)
    this.rtp = null;                 // WebRTC: {rtp, pts} of the first frame shown, to read a frame's pts
    this.firstPts = null;
    this.connect(transportChoice);
  }

  // "auto": WebRTC where it connects, the socket otherwise (and always for a picture or clip to start from,
  // whose bytes go over the socket).
  async connect(choice) {
    const handlers = {
      onText: (text) => this.onMessage(text),
      onBinary: (buf) => this.onBinary(buf),
      onClose: (why) => this.onTransportClose(why),
      onError: (why) => log("error", why),
    };
    const picture = input.startInput() !== null;
    if (choice === "webrtc" || (choice === "auto" && !picture && "RTCPeerConnection" in window)) {
      const peer = new PeerTransport(handlers, ui.video);
      this.transport = peer;
      try {
        await peer.connect();
        render();
        return;
      } catch (err) {
        peer.close();
        if (this.state === "closed") return;
        if (choice === "webrtc" || err.status === 503 || err.status === 429) {
          // Refused before any media: told as a socket's `closed` would tell it (the same notice and log).
          log("error", `WebRTC: ${err.message}`);
          this.lastError = { message: err.message };
          if (err.code) this.onClosed({ reason: err.code, retry_after_s: err.retryAfter });
          else this.setState("closed");
          return;
        }
        log("info", `WebRTC did not connect (${err.message}): using the WebSocket`);
      }
    }
    this.transport = new SocketTransport(handlers);
    render();
  }

  get open() { return this.transport !== null && this.transport.isOpen; }
  get transportKind() { return this.transport ? this.transport.kind : null; }

  send(type, fields = {}, description = type) {
    if (!this.open) { log("error", `cannot send ${type}: not connected`); return; }
    const id = `m${++this.seq}`;
    this.sent.set(id, description);
    // Controls whose effect the server names in a chunk (`controls`): timed from here to the screen.
    const shows = type === "prompt" || type === "reset" || (type === "live" && fields.strength !== null);
    if (shows) this.controlsSent.set(id, performance.now());
    this.transport.send(JSON.stringify({ type, id, ...fields }));
  }

  // `start`, announcing the chosen picture or clip, whose bytes must be the very next message.
  sendStart(fields) {
    let media = input.startInput();
    if (media && this.transportKind === "webrtc") {
      log("hint", "pictures and clips go over the WebSocket: choose it (or auto) to start from one");
      media = null;
    }
    const described = `start “${short(fields.prompt)}”${media ? ` from the ${media.announcement.kind}` : ""}`;
    this.send("start", media ? { ...fields, input: media.announcement } : fields, described);
    if (media && this.open) this.transport.sendBinary(media.buffer);
  }

  // --- messages from the server ---

  onMessage(data) {
    let msg;
    try { msg = JSON.parse(data); } catch { log("error", "unreadable message from the server"); return; }
    switch (msg.type) {
      case "session": this.onSession(msg); break;
      case "chunk":
        if (this.transportKind === "webrtc") { this.onChunk(msg); break; }  // its frames come on the track
        this.pendingChunk = msg; this.expect = "media"; break;
      case "ack": this.onAck(msg); break;
      case "state":
        this.setState(msg.state);
        log("state", `state ${msg.state}${msg.reason ? ` (${msg.reason})` : ""}`);
        break;
      case "error":
        this.lastError = msg;
        log("error", `${msg.code}: ${msg.message}${msg.id && this.sent.has(msg.id) ? ` [${this.sent.get(msg.id)}]` : ""}`);
        break;
      case "closed":
        this.onClosed(msg);
        break;
      default:
        log("info", `ignored message type ${msg.type}`);
    }
  }

  onClosed(msg) {
    const retry = typeof msg.retry_after_s === "number" ? msg.retry_after_s : null;
    const when = retry === null ? "later" : `in ${Math.max(1, Math.ceil(retry))} s`;
    log("state", `closed (${msg.reason})${retry === null ? "" : `, retry after ${retry} s`}`);
    if (msg.reason === "capacity") {
      // A warming-up server says so in the `error` just before; otherwise every slot is taken.
      const warming = this.lastError && /warm/i.test(this.lastError.message || "");
      notice(warming ? `The server is still warming up. Try again ${when}.`
                     : `The server is busy: every session slot is in use. Try again ${when}.`);
    } else if (msg.reason === "draining") {
      notice(`The server is shutting down. Try again ${when}.`);
    }
    this.setState("closed");
  }

  onSession(msg) {
    this.sessionId = msg.session_id;
    window.arstreamDemo.sessionId = msg.session_id;
    const v = msg.video || {};
    const audio = msg.audio ? `${msg.audio.codec} ${msg.audio.sample_rate / 1000} kHz` : "no audio";
    const over = msg.transport === "webrtc" ? "WebRTC" : "WebSocket";
    ui.mediaInfo.textContent = `${v.width}×${v.height} @ ${v.fps} fps · ${v.codec} · ${audio} · over ${over}`;
    ui.transportInUse.textContent = over;
    this.frameSize = { width: v.width, height: v.height };
    this.fps = v.fps;
    ui.mute.title = msg.audio ? "Toggle sound" : "This stream has no audio track";
    log("info", `session ${msg.session_id.slice(0, 6)}… ${msg.mime}`);
    if (msg.transport !== "webrtc") {
      if (!this.setupMedia(msg.mime)) { this.transport.close(); return; }
      this.expect = "init";
    } else {
      if (ui.video.paused) ui.video.play().catch(() => {});
      watchFrames(this, true);  // from the first frame: it calibrates the RTP timestamps
    }
    this.setState(msg.state);
    if (msg.state === "created" && this.startFields) {
      this.sendStart(this.startFields);
      this.startFields = null;
    }
    if (this === current) input.bind(this);
  }

  onAck(msg) {
    const what = (msg.id && this.sent.get(msg.id)) || msg.of;
    this.sent.delete(msg.id);
    log("ack", `ack ${msg.of}: ${what}`);
    if (msg.of === "start" || msg.of === "prompt") {
      // The prompt is used as it is; words outside the model's vocabulary are simply not shown.
      const unknown = msg.unknown_words || [];
      notice(unknown.length ? `This model does not know ${unknown.map((w) => `“${w}”`).join(", ")}: ` +
        "it shows only the words it knows (try the examples above)." : "");
    }
    if (msg.of === "live") input.onLiveAck(msg);
    // The server also sends `state`; this keeps the buttons right if it comes later.
    const after = { start: "active", resume: "active", pause: "paused" }[msg.of];
    if (after) this.setState(after);
  }

  onBinary(buf) {
    const kind = this.expect;
    this.expect = null;
    if (kind === "init") { this.enqueue(buf); return; }
    if (kind !== "media") { log("error", "unexpected binary message"); return; }
    const chunk = this.pendingChunk;
    this.pendingChunk = null;
    this.enqueue(buf);
    this.onChunk(chunk);
  }

  onChunk(chunk) {
    const now = performance.now();
    this.chunks += 1;
    if (this.firstPts === null) this.firstPts = chunk.pts;
    // The chunk's first frame is the first to show these controls: time them to the screen.
    for (const id of chunk.controls || []) {
      const sentAt = this.controlsSent.get(id);
      if (sentAt === undefined) continue;
      this.controlsSent.delete(id);
      this.controlsDue.push({ id, sentAt, namedAt: now, pts: chunk.pts });
      watchFrames(this);
    }
    // A chunk made from live input names the camera frame its first frame shows: time it from its capture.
    if (typeof chunk.input_frame === "number") {
      const capturedAt = input.capturedAt(this, chunk.input_frame);
      if (capturedAt !== null) {
        this.cameraDue.push({ number: chunk.input_frame, capturedAt, pts: chunk.pts });
        if (this.cameraDue.length > CAMERA_KEEP) this.cameraDue.shift();
        watchFrames(this);
      }
    }
    if (this.firstChunkMs === null) this.firstChunkMs = now - this.startClick;
    this.arrivals.push({ t: now, frames: chunk.frames });
    while (this.arrivals.length > 2 && now - this.arrivals[0].t > FPS_WINDOW_MS) this.arrivals.shift();
    const t = chunk.timings || {};
    if (typeof t.started_at === "number") {
      // Server clock → this clock: exact on one host, off by the clock skew on a remote one.
      this.latencies.push(Date.now() - t.started_at);
      if (this.latencies.length > LATENCY_KEEP) this.latencies.shift();
    }
    this.timings = t;
    render();
  }

  onTransportClose(why) {
    if (this.state !== "closed") {
      log("error", `connection closed (${why})`);
    }
    this.setState("closed");
    this.ending = true;
    this.pump();
  }

  setState(state) {
    this.state = state;
    if (state === "closed") input.unbind(this);
    if (this === current) render();
  }

  // --- Media Source Extensions ---

  setupMedia(mime) {
    if (this.sb && mime === this.mime) return true;  // re-announced: keep the SourceBuffer
    if (!("MediaSource" in window) || !MediaSource.isTypeSupported(mime)) {
      log("error", `this browser cannot play ${mime}`);
      return false;
    }
    this.mime = mime;
    const ms = new MediaSource();
    this.ms = ms;
    ms.addEventListener("sourceopen", () => {
      URL.revokeObjectURL(ui.video.src);
      const sb = ms.addSourceBuffer(mime);
      sb.mode = "segments";
      sb.addEventListener("updateend", () => { this.afterAppend(); this.pump(); });
      sb.addEventListener("error", () => log("error", "SourceBuffer error"));
      this.sb = sb;
      this.pump();
    }, { once: true });
    ui.video.src = URL.createObjectURL(ms);
    return true;
  }

  enqueue(buf) {
    this.queue.push(buf);
    this.pump();
  }

  pump() {
    const { ms, sb } = this;
    if (!sb || sb.updating || ms.readyState !== "open") return;
    if (this.trim(false)) return;  // a remove() is running; its updateend pumps again
    const buf = this.queue.shift();
    if (!buf) {
      if (this.ending) ms.endOfStream();
      return;
    }
    try {
      sb.appendBuffer(buf);
    } catch (err) {
      if (err.name === "QuotaExceededError" && this.trim(true)) {
        this.queue.unshift(buf);  // retried after the removal
      } else {
        log("error", `append failed: ${err.name}`);
      }
    }
  }

  // Keep the buffer bounded: drop what lies more than KEEP_BEHIND_S behind the playhead.
  trim(urgent) {
    const b = this.sb.buffered;
    if (!b.length) return false;
    const keepFrom = ui.video.currentTime - (urgent ? 2 : KEEP_BEHIND_S);
    if (keepFrom - b.start(0) < (urgent ? 0.5 : TRIM_STEP_S)) return false;
    this.sb.remove(b.start(0), keepFrom);
    return true;
  }

  afterAppend() {
    const v = ui.video;
    const b = v.buffered;
    if (!b.length) return;
    // A stream attached mid-session starts at pts / fps, not 0.
    if (v.currentTime < b.start(0)) v.currentTime = b.start(0);
    if (v.paused && this.state !== "closed") v.play().catch(() => {});
  }

  close() {
    if (this.transport) this.transport.close();
    if (ui.video.srcObject) ui.video.srcObject = null;
  }

  // The pts of a frame the video element presents: over the socket its media time; over WebRTC its RTP timestamp
  // (90 kHz, from a random origin) against the first frame shown, which is the first frame sent.
  presentedPts(meta) {
    const fps = this.fps || 16;
    if (this.transportKind !== "webrtc") return Math.round(meta.mediaTime * fps);
    if (typeof meta.rtpTimestamp !== "number") return null;
    if (this.rtp === null) this.rtp = { rtp: meta.rtpTimestamp, pts: this.firstPts || 0 };
    const ticks = (meta.rtpTimestamp - this.rtp.rtp + 2 ** 32) % 2 ** 32;
    return this.rtp.pts + Math.round(ticks / (90000 / fps));
  }
}

// --- control to screen: a frame shown that a control's chunk began ---

// Each frame the video element presents is checked against the controls waiting to be seen; the first frame
// at or after a control's chunk is when it reached the screen (requestVideoFrameCallback: per presented frame).
function watchFrames(s, always = false) {
  const v = ui.video;
  if (s.watching || !("requestVideoFrameCallback" in v)) return;
  s.watchAlways = s.watchAlways || always;
  s.watching = true;
  const onFrame = (now, meta) => {
    const shownAt = meta.expectedDisplayTime || now;
    const pts = s.presentedPts(meta);
    s.controlsDue = s.controlsDue.filter((due) => {
      if (pts === null || pts < due.pts) return true;
      s.toScreen.push(shownAt - due.sentAt);
      if (s.toScreen.length > CONTROL_KEEP) s.toScreen.shift();
      // namedMs: the chunk naming the control arrived (the server's part and the network's); the rest is the
      // player's (its buffer, the transport's pacing, decode and paint).
      window.arstreamDemo.toScreen.push({ id: due.id, ms: shownAt - due.sentAt, namedMs: due.namedAt - due.sentAt,
                                          pts, mediaTime: pts / (s.fps || 16) });
      return false;
    });
    s.cameraDue = s.cameraDue.filter((due) => {
      if (pts === null || pts < due.pts) return true;
      s.cameraToScreen.push(shownAt - due.capturedAt);
      if (s.cameraToScreen.length > CAMERA_KEEP) s.cameraToScreen.shift();
      const shown = window.arstreamDemo.cameraToScreen;
      shown.push({ inputFrame: due.number, ms: shownAt - due.capturedAt, pts, mediaTime: pts / (s.fps || 16) });
      if (shown.length > CAMERA_EXPORT_KEEP) shown.shift();
      return false;
    });
    if ((s.controlsDue.length || s.cameraDue.length || s.watchAlways) && s === current && s.state !== "closed") {
      v.requestVideoFrameCallback(onFrame);
    } else {
      s.watching = false;
    }
    render();
  };
  v.requestVideoFrameCallback(onFrame);
}

// For tests and curious users: every control timed on this page (id, ms, mediaTime of the frame), the camera's
// frames timed to the screen (inputFrame, ms, mediaTime; over the socket) and the session; cameraLimits false
// sends the camera over WebRTC as captured (the reference bench/camera_cost_browser.py times).
window.arstreamDemo = { toScreen: [], cameraToScreen: [], sessionId: null, cameraLimits: true };

// --- playback upkeep: gaps, live edge, readouts ---

function tick() {
  const v = ui.video;
  const b = v.buffered;
  if (current && b.length && !v.seeking) {
    const t = v.currentTime;
    const end = b.end(b.length - 1);
    let inside = false;
    for (let i = 0; i < b.length; i++) inside ||= b.start(i) <= t && t < b.end(i);
    if (!inside) {
      for (let i = 0; i < b.length; i++) {
        if (b.start(i) > t) { v.currentTime = b.start(i); break; }  // jump a gap
      }
    } else if (end - t > MAX_LAG_S) {
      v.currentTime = end - 1;  // fell behind (background tab, slow decode): back to the live edge
    }
    // Near the live edge: what is sent plays soon after; behind it, catch up a little faster.
    const rate = end - v.currentTime > LIVE_EDGE_S ? CATCH_UP_RATE : 1;
    if (v.playbackRate !== rate) v.playbackRate = rate;
  }
  render();
}

function fps(s) {
  const a = s.arrivals;
  const now = performance.now();
  if (!a.length) return null;
  const span = a[a.length - 1].t - a[0].t;
  const interval = a.length > 1 ? span / (a.length - 1) : 0;
  if (now - a[a.length - 1].t > Math.max(STALL_MS, 2 * interval)) return 0;  // stalled or stopped
  if (a.length < 2) return null;
  const frames = a.slice(1).reduce((n, x) => n + x.frames, 0);
  return (1000 * frames) / span;
}

const ms = (x) => `${Math.round(x)} ms`;

function render() {
  const s = current;
  const state = s ? s.state : "idle";
  ui.state.textContent = state;
  ui.state.dataset.state = state;

  const live = s && s.open && state !== "closed";
  ui.start.disabled = live && state !== "created";
  ui.pause.disabled = !(live && ["active", "paused"].includes(state));
  ui.pause.textContent = live && state === "paused" ? "Resume" : "Pause";
  ui.apply.disabled = !(live && ["active", "paused"].includes(state));
  ui.reset.disabled = ui.apply.disabled;
  ui.close.disabled = !live;
  ui.mute.textContent = ui.video.muted ? "Unmute" : "Mute";
  if (!s) return;

  const f = fps(s);
  ui.fps.textContent = f === null ? "–" : f.toFixed(1);
  ui.ttfc.textContent = s.firstChunkMs === null ? "–" : ms(s.firstChunkMs);
  ui.chunks.textContent = String(s.chunks);
  if (s.latencies.length) {
    ui.latency.textContent = `${ms(s.latencies[s.latencies.length - 1])} (median ${ms(median(s.latencies))})`;
  }
  const t = s.timings;
  if (t) {
    ui.server.textContent =
      `queue ${Math.round(t.queued_ms)} · denoise ${Math.round(t.denoise_ms)} · ` +
      `decode ${Math.round(t.decode_ms)} · encode ${Math.round(t.encode_ms)} ms`;
  }
  if (s.toScreen.length) {
    ui.toScreen.textContent = `${ms(s.toScreen[s.toScreen.length - 1])} (median ${ms(median(s.toScreen))})`;
  } else {
    ui.toScreen.textContent = "–";
  }
  ui.cameraToScreen.textContent = s.cameraToScreen.length
    ? `${ms(s.cameraToScreen[s.cameraToScreen.length - 1])} (median ${ms(median(s.cameraToScreen))})`
    : "–";
  const v = ui.video;
  const b = v.buffered;
  if (b.length) ui.buffer.textContent = `${Math.max(0, b.end(b.length - 1) - v.currentTime).toFixed(2)} s`;
  const q = v.getVideoPlaybackQuality ? v.getVideoPlaybackQuality() : null;
  if (q) ui.decoded.textContent = `${q.totalVideoFrames} / ${q.droppedVideoFrames} dropped`;
}

// --- controls ---

function promptText() {
  const prompt = ui.prompt.value.trim();
  if (!prompt) { log("hint", "type the new prompt in the box first"); ui.prompt.focus(); return null; }
  return prompt;
}

function start() {
  let prompt = ui.prompt.value.trim();
  if (!prompt) {
    prompt = EXAMPLE_PROMPT;  // the box was left empty: generate the example it shows
    ui.prompt.value = prompt;
    log("info", "no prompt typed: starting with the example prompt");
  }
  const fields = { prompt };
  if (ui.seed.value !== "") {
    const seed = Number(ui.seed.value);
    if (!Number.isInteger(seed) || seed < 0) { log("hint", "seed must be an integer ≥ 0, or empty for a random one"); return; }
    fields.seed = seed;
  }
  notice("");
  if (current && current.open && current.state === "created") {
    current.startClick = performance.now();
    current.sendStart(fields);
    return;
  }
  if (current) current.close();
  errorCount = 0;  // the counter is per session
  ui.errors.textContent = "0";
  current = new Session(fields, ui.transport.value);
  render();
}

function togglePause() {
  if (!current) return;
  if (current.state === "paused") current.send("resume");
  else current.send("pause", {}, "pause (the session keeps its memory)");
}

function changePrompt() {
  const prompt = promptText();
  if (prompt === null || !current) return;
  const policy = ui.policy.value;
  current.send("prompt", { prompt, policy }, `prompt (${policy}) “${short(prompt)}”`);
}

ui.start.addEventListener("click", start);
ui.pause.addEventListener("click", togglePause);
ui.apply.addEventListener("click", changePrompt);
ui.reset.addEventListener("click", () => current && current.send("reset"));
ui.close.addEventListener("click", () => current && current.send("close"));
ui.mute.addEventListener("click", () => {
  const v = ui.video;
  v.muted = !v.muted;
  if (!v.muted) v.play().catch(() => {});  // a click is the user gesture that allows sound
  render();
});
ui.prompt.addEventListener("keydown", (ev) => {
  if (ev.key !== "Enter" || !(ev.ctrlKey || ev.metaKey)) return;
  ev.preventDefault();
  if (!ui.apply.disabled) changePrompt(); else if (!ui.start.disabled) start();
});
window.addEventListener("pagehide", () => {
  if (current && current.open) current.transport.send(JSON.stringify({ type: "close" }));  // free the session now
});

ui.prompt.placeholder = `e.g. ${EXAMPLE_PROMPT}`;
ui.video.muted = true;  // muted autoplay is allowed everywhere; sound comes on with a click
setInterval(tick, 100);
render();

// Example prompts (the built-in tiny model's caption grammar): a click puts one in the prompt box.
for (const button of document.querySelectorAll("#examples button[data-prompt]")) {
  button.addEventListener("click", () => { ui.prompt.value = button.dataset.prompt; ui.prompt.focus(); });
}
