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
