// Pictures and video in (docs/PROTOCOL.md): a picture or clip to start from, and the camera as live input.
// The page's Session (app.js) asks this panel what to announce on `start`, and binds it once the server
// announced the session, so the camera's frames go to that session's socket.

const FRAME_QUALITY = 0.8;          // JPEG quality of camera frames
const MAX_UNSENT_BYTES = 256 * 1024; // a socket holding more than this unsent skips camera frames (no queue)
const CAPTURED_KEEP = 256;          // capture times kept by frame number (16 s at 16 fps: far more than a lead)

export class InputPanel {
  constructor(ui, log) {
    this.ui = ui;                    // file, clearFile, camera, strength, strengthText, inputView, inputImage, inputVideo, inputInfo
    this.log = log;
    this.picked = null;              // {kind: "image" | "clip", buffer, url, name}
    this.stream = null;              // the camera's MediaStream
    this.session = null;             // the Session the camera feeds
    this.timer = null;
    this.canvas = document.createElement("canvas");
    this.framesSent = 0;
    this.framesSkipped = 0;
    // Over the socket the server numbers the frames it receives while live is on, from 0 over the session's
    // life (chunk.input_frame): the n-th frame sent to this session is number n. Its capture time, by number.
    this.captured = new Map();
    this.used = null;                // {strength, steps} from the server's ack of `live`
    this.liveRun = 0;                // bumped when live input stops: a frame still being encoded is not sent

    ui.file.addEventListener("change", () => this.pick(ui.file.files[0] || null));
    ui.clearFile.addEventListener("click", () => { ui.file.value = ""; this.pick(null); });
    ui.camera.addEventListener("click", () => (this.stream ? this.stopCamera() : this.startCamera()));
    ui.strength.addEventListener("change", () => {
      this.showStrength();
      if (this.stream && this.session) this.session.send("live", { strength: this.strength }, `live ${this.strength}`);
    });
    this.showStrength();
    this.render();
  }

  get strength() { return Number(this.ui.strength.value); }

  // --- a picture or clip to start from ---

  async pick(file) {
    if (this.picked) URL.revokeObjectURL(this.picked.url);
    this.picked = null;
    if (file) {
      const kind = file.type.startsWith("video/") ? "clip" : "image";
      this.picked = { kind, buffer: await file.arrayBuffer(), url: URL.createObjectURL(file), name: file.name };
      this.log("info", `${kind} chosen to start from: ${file.name} (${file.size} bytes)`);
    }
    this.render();
  }

  // What `start` announces, and the bytes that follow it as the next message; null: none chosen.
  startInput() {
    if (!this.picked) return null;
    return { announcement: { kind: this.picked.kind, bytes: this.picked.buffer.byteLength }, buffer: this.picked.buffer };
  }

  // --- the camera ---

  async startCamera() {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      this.log("error", "this browser offers no camera here (getUserMedia needs localhost or https)");
      return;
    }
    try {
      this.stream = await navigator.mediaDevices.getUserMedia({ video: { width: { ideal: 640 } }, audio: false });
    } catch (err) {
      this.log("error", `camera: ${err.name}`);
      return;
    }
    this.ui.inputVideo.srcObject = this.stream;
    this.ui.inputVideo.play().catch(() => {});
    this.log("info", "camera on");
    this.render();
    if (this.session) this.goLive();
  }

  stopCamera() {
    clearInterval(this.timer);
    this.timer = null;
    this.liveRun += 1;  // after `live` off a binary message is a protocol error: no frame may follow it
    for (const track of this.stream ? this.stream.getTracks() : []) track.stop();
    this.stream = null;
    this.ui.inputVideo.srcObject = null;
    if (this.session && this.session.transportKind === "webrtc") this.session.transport.setCamera(null).catch(() => {});
    if (this.session && this.session.open) this.session.send("live", { strength: null }, "live off");
    this.used = null;
    this.log("info", "camera off");
    this.render();
  }

  // The session is announced (or was replaced): the camera, when on, feeds it from now on.
  bind(session) {
    this.session = session;
    this.framesSent = this.framesSkipped = 0;
    this.captured.clear();
    if (this.stream) this.goLive();
  }

  unbind(session) {
    if (this.session !== session) return;
    clearInterval(this.timer);
    this.timer = null;
    this.liveRun += 1;
    this.session = null;
    this.used = null;
    this.render();
  }

  goLive() {
    const session = this.session;
    session.send("live", { strength: this.strength }, `live ${this.strength}`);
    clearInterval(this.timer);
    if (session.transportKind === "webrtc") {
      // Over WebRTC the camera is a video track of the peer connection: the browser encodes and paces it.
      const limits = session.frameSize ? { fps: session.fps || 16, ...session.frameSize } : null;
      session.transport.setCamera(this.stream.getVideoTracks()[0], limits)
        .catch((err) => this.log("error", `camera: ${err}`));
      return;
    }
    this.timer = setInterval(() => this.sendFrame(session), 1000 / (session.fps || 16));
  }

  // When the camera frame a chunk names (chunk.input_frame) was captured here, or null: not this session's,
  // or sent over WebRTC (the server counts the track's frames it got, which the page cannot match one by one).
  capturedAt(session, number) {
    if (session !== this.session || session.transportKind === "webrtc") return null;
    const at = this.captured.get(number);
    return at === undefined ? null : at;
  }

  onLiveAck(msg) {
    this.used = typeof msg.strength === "number" ? { strength: msg.strength, steps: msg.steps } : null;
    this.showStrength();
  }

  sendFrame(session) {
    const video = this.ui.inputVideo;
    if (!session.open || !session.frameSize || video.readyState < 2) return;
    if (session.transport.bufferedAmount > MAX_UNSENT_BYTES) { this.framesSkipped += 1; return; }
    // Cover and centre-crop to the session's frame here, as the server would: fewer bytes on the wire.
    const { width, height } = session.frameSize;
    const capturedAt = performance.now();
    const canvas = this.canvas;
    canvas.width = width;
    canvas.height = height;
    const scale = Math.max(width / video.videoWidth, height / video.videoHeight);
    const w = video.videoWidth * scale;
    const h = video.videoHeight * scale;
    canvas.getContext("2d").drawImage(video, (width - w) / 2, (height - h) / 2, w, h);
    const run = this.liveRun;
    canvas.toBlob((blob) => {
      // Encoding is asynchronous: the camera may have been stopped (`live` off sent) meanwhile.
      if (!blob || !session.open || this.session !== session || run !== this.liveRun || !this.stream) return;
      session.transport.sendBinary(blob);
      this.captured.set(this.framesSent, capturedAt);
      if (this.captured.size > CAPTURED_KEEP) this.captured.delete(this.captured.keys().next().value);
      this.framesSent += 1;
      this.render();
    }, "image/jpeg", FRAME_QUALITY);
  }

  // --- readouts ---

  showStrength() {
    const asked = this.strength.toFixed(2);
    const used = this.used ? ` → σ ${this.used.strength} · ${this.used.steps} step${this.used.steps === 1 ? "" : "s"}` : "";
    this.ui.strengthText.textContent = `${asked}${used}`;
  }

  render() {
    const { ui, picked, stream } = this;
    ui.camera.textContent = stream ? "Stop camera" : "Camera";
    ui.clearFile.disabled = !picked;
    ui.inputView.hidden = !picked && !stream;
    ui.inputImage.hidden = !(picked && picked.kind === "image") || Boolean(stream);
    ui.inputVideo.hidden = !stream && !(picked && picked.kind === "clip");
    if (!stream && picked) {
      if (picked.kind === "image") ui.inputImage.src = picked.url;
      else if (ui.inputVideo.src !== picked.url) { ui.inputVideo.src = picked.url; ui.inputVideo.loop = true; ui.inputVideo.play().catch(() => {}); }
    }
    const overPeer = this.session && this.session.transportKind === "webrtc";
    ui.inputInfo.textContent = stream
      ? (overPeer ? "camera · a WebRTC video track"
        : `camera · ${this.framesSent} frames sent${this.framesSkipped ? `, ${this.framesSkipped} skipped` : ""}`)
      : picked ? `${picked.kind}: ${picked.name}` : "";
  }
}
