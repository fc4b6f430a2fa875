"""Issue 30 probe: under "still", where does the second copy of a pictured object appear, at two frame widths?
If it is the DiT's fastest width-axis rotary frequency (1 rad per 16-px token), the copy sits ~100 px from the
object whatever the frame's width."""
import sys, json
import numpy as np, torch
from engine.kv_cache import KVCacheManager
from engine.runner import runner_for
from tests.input_helpers import run_session, scene_picture
from train import checks
from world.grammar import COLOURS, Scene
from world.render import Shades
torch.set_num_threads(2)
EVERYDAY_BLUE = (35, 60, 190)

def red_blobs(frame):
    f = frame.astype(int)
    mask = (f[..., 0] > 140) & (f[..., 1] < 110) & (f[..., 2] < 130)
    cols = mask.sum(axis=0)
    xs = np.nonzero(cols >= 2)[0]
    if len(xs) == 0:
        return []
    groups, start = [], xs[0]
    for a, b in zip(xs[:-1], xs[1:]):
        if b - a > 3:
            groups.append((start, a)); start = b
    groups.append((start, xs[-1]))
    return [(round(float((np.arange(s, e + 1) * cols[s:e + 1]).sum() / cols[s:e + 1].sum()), 1), int(cols[s:e + 1].sum()))
            for s, e in groups]

results = {}
for width in tuple(int(w) for w in sys.argv[1:]) or (256, 320):
    bundle = checks.build(width=width, height=144)
    runner = runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu"))
    for x in (40.0,) if width != 256 else (40.0, 80.0):
        scene = Scene("circle", "red", "still", "blue")
        picture = scene_picture(scene, x, 60.0, Shades(COLOURS["red"], tuple(v / 255 for v in EVERYDAY_BLUE)))
        if width > 256:
            pad = np.empty((1, 144, width - 256, 3), dtype=np.uint8)
            pad[:] = picture[:, :, -1:, :]  # the background's edge colour
            picture = np.concatenate([picture, pad], axis=2)
        elif width < 256:
            picture = np.ascontiguousarray(picture[:, :, :width, :])
        chunks = run_session(runner, "copy", scene.caption, blocks=5, context=picture)
        generated = np.concatenate(chunks[1:])[:36]
        per_frame = [red_blobs(f) for f in generated]
        last = per_frame[-8:]
        results[f"w{width}_x{int(x)}"] = {"frames_with_2plus_blobs": sum(len(b) >= 2 for b in per_frame),
                                           "last_frames": last}
        print(width, x, results[f"w{width}_x{int(x)}"]["frames_with_2plus_blobs"], last[-3:], flush=True)
json.dump(results, open("/tmp/s22/copy_exp_%s.json" % "_".join(sys.argv[1:] or ["256", "320"]), "w"))
