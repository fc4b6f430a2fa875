"""Debian's Chromium for the browser tests and benchmarks (Playwright drives it; never `playwright install`)."""

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--autoplay-policy=no-user-gesture-required",
]

# Reads each frame the video element presents (requestVideoFrameCallback) into a canvas and counts the pixels
# near yellow and near red: what a viewer sees, not what the server logged.
COLOUR_READER = """() => {
    const v = document.querySelector("video");
    const canvas = document.createElement("canvas");
    const ctx = canvas.getContext("2d", { willReadFrequently: true });
    window.shown = [];
    const onFrame = (now, meta) => {
        canvas.width = v.videoWidth; canvas.height = v.videoHeight;
        ctx.drawImage(v, 0, 0);
        const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
        let yellow = 0, red = 0;
        for (let i = 0; i < px.length; i += 4) {
            const [r, g, b] = [px[i], px[i + 1], px[i + 2]];
            if (r > 170 && g > 150 && b < 110) yellow += 1;
            else if (r > 150 && g < 90 && b < 90) red += 1;
        }
        window.shown.push({ at: meta.expectedDisplayTime || now, mediaTime: meta.mediaTime, yellow, red });
        if (window.shown.length > 4000) window.shown.shift();
        v.requestVideoFrameCallback(onFrame);
    };
    v.requestVideoFrameCallback(onFrame);
}"""


# Installs window.likeness(mode): how far the video element's frame is from the camera's preview
# (`#input-video`), both cover-cropped to the video's aspect and scaled to 32 x 18: the mean absolute difference
# per colour channel (0-255). mode "keep" keeps the video's current frame (window.kept); "kept" compares that
# frame instead of the live one.
LIKENESS = """() => {
    const small = (source, sw, sh) => {
        const c = document.createElement("canvas"); c.width = 32; c.height = 18;
        const ctx = c.getContext("2d", { willReadFrequently: true });
        const scale = Math.max(32 / sw, 18 / sh);
        const w = sw * scale, h = sh * scale;
        ctx.drawImage(source, (32 - w) / 2, (18 - h) / 2, w, h);
        return ctx.getImageData(0, 0, 32, 18).data;
    };
    window.likeness = (mode) => {
        const v = document.querySelector("#video"), cam = document.querySelector("#input-video");
        if (mode === "keep") { window.kept = small(v, v.videoWidth, v.videoHeight); return null; }
        const out = mode === "kept" ? window.kept : small(v, v.videoWidth, v.videoHeight);
        const inp = small(cam, cam.videoWidth, cam.videoHeight);
        let total = 0, n = 0;
        for (let i = 0; i < out.length; i += 4) {
            for (let k = 0; k < 3; k++) { total += Math.abs(out[i + k] - inp[i + k]); n += 1; }
        }
        return total / n;
    };
}"""
