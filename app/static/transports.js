// How the demo page reaches a session: the WebSocket (fragmented MP4 after each `chunk`, played through Media
// Source Extensions) or a WebRTC peer connection (the server's tracks played by the video element itself, the v1
// control messages on a data channel, the camera as a track). Both carry the same JSON messages; the page's
// Session (app.js) does not care which. docs/PROTOCOL.md ("WebRTC") is the contract.

const PEER_CONNECT_TIMEOUT_MS = 8000;  // a peer that has not connected by then: the page falls back to the socket

function bearerToken() {
  return new URLSearchParams(location.hash.slice(1)).get("token");
}

export class SocketTransport {
  constructor(handlers) {
    this.kind = "websocket";
    this.handlers = handlers;  // {onText, onBinary, onClose, onError}
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    // Browsers cannot set headers on a WebSocket: a token travels as the subprotocol bearer.<token>.
    const token = bearerToken();
    this.ws = new WebSocket(`${scheme}://${location.host}/v1/stream`, token ? ["arstream.v1", `bearer.${token}`] : ["arstream.v1"]);
    this.ws.binaryType = "arraybuffer";
    this.ws.onmessage = (ev) => (typeof ev.data === "string" ? handlers.onText(ev.data) : handlers.onBinary(ev.data));
    this.ws.onclose = (ev) => handlers.onClose(`${ev.code}${ev.reason ? ` ${ev.reason}` : ""}`);
    this.ws.onerror = () => handlers.onError("WebSocket error");
  }

  get isOpen() { return this.ws.readyState === WebSocket.OPEN; }
  get bufferedAmount() { return this.ws.bufferedAmount; }
  send(text) { this.ws.send(text); }
  sendBinary(data) { this.ws.send(data); }
  close() {
    this.ws.onmessage = this.ws.onclose = this.ws.onerror = null;
    if (this.isOpen) this.ws.close(1000);
  }
}

export class PeerTransport {
  // connect() resolves once the data channel is open, or rejects (the caller may fall back to the socket).
  constructor(handlers, video) {
    this.kind = "webrtc";
    this.handlers = handlers;  // {onText, onClose, onError}
    this.video = video;
    this.pc = null;            // made in connect(), once the server said which STUN/TURN servers to use
    this.channel = null;
    this.videoTransceiver = null;
    this.closed = false;
    this.resource = null;      // the session's WebRTC resource (Location), for DELETE
  }

  // The server's STUN/TURN servers, as WHEP tells them: `Link: <url>; rel="ice-server"; username=...` on
  // OPTIONS /v1/webrtc. None configured (the default): host candidates only.
  async iceServers(headers) {
    let link = null;
    try { link = (await fetch("/v1/webrtc", { method: "OPTIONS", headers })).headers.get("Link"); } catch { /* none */ }
    const servers = [];
    for (const value of (link || "").split(/,(?=\s*<)/)) {
      const url = /<([^>]+)>/.exec(value);
      if (!url || !/rel="ice-server"/.test(value)) continue;
      const server = { urls: url[1] };
      const username = /username="([^"]*)"/.exec(value);
      const credential = /credential="([^"]*)"/.exec(value);
      if (username && credential) { server.username = username[1]; server.credential = credential[1]; }
      servers.push(server);
    }
    return servers;
  }

  setUp(iceServers) {
    const handlers = this.handlers;
    this.pc = new RTCPeerConnection({ iceServers });
    if (window.arstreamDemo) window.arstreamDemo.peer = this.pc;  // for tests and benchmarks: getStats()
    // One video transceiver both ways: the server's frames come in, the camera (when on) goes out on it, so
    // switching the camera on needs no renegotiation (replaceTrack).
    this.videoTransceiver = this.pc.addTransceiver("video", { direction: "sendrecv" });
    this.pc.addTransceiver("audio", { direction: "recvonly" });
    this.channel = this.pc.createDataChannel("arstream");
    this.channel.onmessage = (ev) => (typeof ev.data === "string" ? handlers.onText(ev.data)
                                                                    : handlers.onError("binary message on the data channel"));
    this.stream = new MediaStream();
    this.pc.ontrack = (ev) => {
      this.stream.addTrack(ev.track);
      if (this.video.srcObject !== this.stream) this.video.srcObject = this.stream;
    };
    this.pc.onconnectionstatechange = () => {
      if (["failed", "closed"].includes(this.pc.connectionState) && !this.closed) {
        this.closed = true;
        handlers.onClose(`peer ${this.pc.connectionState}`);
      }
    };
  }

  async connect() {
    const auth = {};
    const token = bearerToken();
    if (token) auth.Authorization = `Bearer ${token}`;
    this.setUp(await this.iceServers(auth));
    if (this.closed) throw new Error("closed");
    await this.pc.setLocalDescription(await this.pc.createOffer());
    await this.iceGathered();
    const headers = { ...auth, "Content-Type": "application/sdp" };
    const answer = await fetch("/v1/webrtc", { method: "POST", headers, body: this.pc.localDescription.sdp });
    if (answer.status !== 201) {
      let detail = `HTTP ${answer.status}`;
      let code = null;
      try {
        const body = await answer.json();
        code = body.error.code;
        detail = `${code}: ${body.error.message}`;
      } catch { /* not JSON */ }
      const error = new Error(detail);
      error.status = answer.status;
      error.code = code;  // the REST error code (capacity, rate_limited, unavailable, ...)
      error.retryAfter = Number(answer.headers.get("Retry-After")) || null;
      throw error;
    }
    this.resource = answer.headers.get("Location");
    await this.pc.setRemoteDescription({ type: "answer", sdp: await answer.text() });
    await new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error("the peer connection did not open")), PEER_CONNECT_TIMEOUT_MS);
      this.channel.onopen = () => { clearTimeout(timer); resolve(); };
    });
    this.channel.onclose = () => {
      if (!this.closed) { this.closed = true; this.handlers.onClose("data channel closed"); }
    };
  }

  iceGathered() {
    // Host candidates gather in milliseconds; the offer carries them (no trickle needed).
    if (this.pc.iceGatheringState === "complete") return Promise.resolve();
    return new Promise((resolve) => {
      const done = () => { if (this.pc.iceGatheringState === "complete") resolve(); };
      this.pc.addEventListener("icegatheringstatechange", done);
      setTimeout(resolve, 2000);
    });
  }

  get isOpen() { return this.channel !== null && this.channel.readyState === "open"; }
  get bufferedAmount() { return this.channel ? this.channel.bufferedAmount : 0; }
  send(text) { this.channel.send(text); }
  sendBinary() { throw new Error("pictures go over the socket"); }

  // The camera as the session's live input, on the peer's video sender (null: off). `limits` ({fps, width, height}: the session's) caps what is
  // sent to what the session takes: its frame rate, and a size that still covers its frame (the server crops and
  // scales to it). The browser then encodes, and the server decodes, that much and no more: a 640x480 camera
  // at 30 fps would cost both of them ~7x the pixels a 256x144 session at 16 fps uses.
  async setCamera(track, limits = null) {
    if (!this.videoTransceiver) return;
    const sender = this.videoTransceiver.sender;
    await sender.replaceTrack(track);
    if (!track || !limits || (window.arstreamDemo || {}).cameraLimits === false) return;
    const { width, height } = track.getSettings();
    const params = sender.getParameters();
    if (!width || !height || !params.encodings || !params.encodings.length) return;
    params.encodings[0].maxFramerate = limits.fps;
    params.encodings[0].scaleResolutionDownBy = Math.max(1, Math.min(width / limits.width, height / limits.height));
    await sender.setParameters(params);
  }

  close() {
    this.closed = true;
    if (this.channel) this.channel.onmessage = this.channel.onclose = null;
    if (this.pc) {
      this.pc.onconnectionstatechange = null;
      this.pc.close();
    }
  }
}
