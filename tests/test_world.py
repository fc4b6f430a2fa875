"""The procedural world: captions, rendering, motion, sound, reproducibility, and the readers the model checks use."""

import numpy as np
import pytest
import torch

from world import measure, sound
from world.clips import make_clip, random_clip, video_frames
from world.grammar import EXAMPLE_PROMPTS, SHAPES, Scene, all_scenes, parse_caption

pytestmark = pytest.mark.background  # computes only (tests/background_pytest.py)


def _frames(clip):
    return ((clip.video.permute(1, 2, 3, 0).numpy() + 1) / 2).astype(np.float32)


def test_caption_round_trips_through_the_parser_for_every_scene():
    for scene in all_scenes():
        assert parse_caption(scene.caption) == scene


def test_parser_reads_free_text_and_refuses_text_without_a_shape():
    scene = parse_caption("Please show a YELLOW triangle, orbiting, on a purple checkered background!")
    assert scene == Scene("triangle", "yellow", "orbiting", "purple", "checkered")
    with pytest.raises(ValueError, match="no shape"):
        parse_caption("a red thing bouncing on a blue background")


def test_scene_refuses_unknown_words_and_invisible_objects():
    with pytest.raises(ValueError, match="unknown colour"):
        Scene("circle", "pink", "still", "blue")
    with pytest.raises(ValueError, match="invisible"):
        Scene("circle", "blue", "still", "blue")


def test_example_prompts_are_captions_of_the_grammar():
    assert len(EXAMPLE_PROMPTS) >= 4
    for prompt in EXAMPLE_PROMPTS:
        assert parse_caption(prompt).caption == prompt


def test_clip_has_the_codecs_frame_counts_and_range():
    clip = make_clip(Scene("circle", "red", "bouncing", "blue"), seed=0, latent_frames=4)
    assert clip.video.shape == (3, video_frames(4), 144, 256) == (3, 13, 144, 256)
    assert clip.features.shape == (sound.FEATURES, 80)
    assert clip.video.min() >= -1 and clip.video.max() <= 1


def test_same_seed_same_clip_other_seed_other_clip():
    a = random_clip(11, 6, switch_probability=0.5)
    b = random_clip(11, 6, switch_probability=0.5)
    c = random_clip(12, 6, switch_probability=0.5)
    assert torch.equal(a.video, b.video) and torch.equal(a.features, b.features) and a.caption == b.caption
    assert not torch.equal(a.video, c.video)


def test_readers_name_colour_background_and_shape_of_rendered_frames():
    for scene in all_scenes()[::9]:
        for frame in _frames(make_clip(scene, seed=3, latent_frames=2))[::2]:
            reading = measure.read_frame(frame)
            assert measure.colour_name(reading) == scene.colour
            assert measure.background_name(reading) == scene.background
            assert measure.shape_name(reading) == scene.shape


def test_moving_objects_move_and_still_ones_do_not():
    speeds = {}
    for motion in ("bouncing", "drifting", "orbiting", "still"):
        frames = _frames(make_clip(Scene("square", "white", motion, "black"), seed=5, latent_frames=9))
        xy = np.array([measure.read_frame(f).centroid for f in frames])
        speeds[motion] = np.linalg.norm(np.diff(xy, axis=0), axis=1).mean() * 16  # px / s
    assert speeds["still"] < 1.0
    assert all(speeds[m] > 20.0 for m in ("bouncing", "drifting", "orbiting")), speeds


def test_switch_changes_the_scene_at_its_latent_frame_and_keeps_the_trajectory():
    old, new = Scene("circle", "red", "drifting", "blue"), Scene("square", "yellow", "drifting", "black")
    clip = make_clip(old, seed=2, latent_frames=9, switch_to=new, switch_latent=6)
    frames = _frames(clip)
    before, after = measure.read_frame(frames[4 * 6 - 4]), measure.read_frame(frames[4 * 6 - 3])
    assert (measure.colour_name(before), measure.colour_name(after)) == ("red", "yellow")
    assert clip.caption == new.caption
    assert np.hypot(*(np.subtract(before.centroid, after.centroid))) < 4.0


def test_sound_is_the_shapes_tone_and_clicks_on_bounces():
    for shape in SHAPES:
        clip = make_clip(Scene(shape, "green", "bouncing", "black"), seed=0, latent_frames=12)
        wave = sound.synthesize(clip.features).numpy()
        assert np.median(measure.dominant_frequencies(wave)) == pytest.approx(measure.tone_of(shape), rel=0.02)
        clicks = (clip.features[4] > 0).nonzero().flatten()
        assert len(clicks) >= 2  # ~2.75 s of a 1.25 s bounce period
    still = make_clip(Scene("circle", "green", "still", "black"), seed=0, latent_frames=12)
    assert (still.features[4] < 0).all()


def test_height_raises_the_octave_partial():
    clip = make_clip(Scene("circle", "red", "bouncing", "blue"), seed=0, latent_frames=12)
    height = clip.features[3].numpy()
    assert height.max() - height.min() > 1.0  # the bounce spans most of the frame


def test_readers_see_no_object_in_noise():
    noise = np.random.default_rng(0).random((144, 256, 3)).astype(np.float32)
    reading = measure.read_frame(noise)
    assert not reading.has_object
    assert measure.colour_name(reading) is None and measure.shape_name(reading) is None


def test_shaded_clips_draw_the_captions_colours_in_other_shades_and_leave_other_clips_as_they_were():
    """Clips in everyday shades (training for pictures off the palette): the caption's colours still read back
    by name, the pixels are not the palette's, and a set drawn without shades is the same as before."""
    from world.grammar import BACKGROUNDS
    from world.render import Shades

    scene = Scene("circle", "red", "still", "blue")
    rng = np.random.default_rng(0)
    shades = [Shades.around(scene, rng) for _ in range(50)]
    grounds = np.array([s.background for s in shades])
    assert np.abs(grounds - np.array(BACKGROUNDS["blue"])).max(axis=1).min() > 0.0
    assert grounds[:, 2].max() > 0.85 and grounds[:, 2].min() < 0.45  # brighter and darker blues
    for s in shades:  # the object always stands out from its ground
        assert np.abs(np.array(s.object) - np.array(s.background)).max() > 0.3
    frame = _frames(make_clip(scene, seed=3, latent_frames=1, shades=shades[0]))[0]
    corner = frame[4, 4] * 255
    assert np.allclose(corner, np.array(shades[0].background) * 255, atol=1.0)
    reading = measure.read_frame(frame)
    assert measure.colour_name(reading) == "red" and measure.background_name(reading) == "blue"
    plain = [random_clip(seed, 2, switch_probability=0.3) for seed in range(6)]
    again = [random_clip(seed, 2, switch_probability=0.3, shades_probability=0.0) for seed in range(6)]
    assert all(torch.equal(a.video, b.video) for a, b in zip(plain, again))
    shaded = [random_clip(seed, 2, shades_probability=1.0) for seed in range(6)]
    assert not any(torch.equal(a.video, b.video) for a, b in zip(plain, shaded))
    with pytest.raises(ValueError, match="one scene"):
        make_clip(scene, 0, 4, switch_to=Scene("circle", "green", "still", "blue"), switch_latent=2, shades=shades[0])


@pytest.mark.parametrize("motion", ["bouncing", "drifting", "orbiting", "still"])
def test_the_nearest_trajectory_continues_a_seen_path_of_every_motion(motion):
    """world.fit: centroids seen over 1.5 s of any path of the motion word (any seed, any moment of an hours-long
    session, 1 px of reading noise) -> a path that goes on where the world's does."""
    from world import motion as paths
    from world.fit import nearest_trajectory

    rng = np.random.default_rng(5)
    for seed in range(4):
        jitter = paths.Jitter.from_seed(seed)
        start = rng.uniform(0, 3600)
        seen, ahead = np.arange(24) / 16, np.arange(24, 36) / 16
        x, y = paths.centre(motion, jitter, start + seen)
        fit = nearest_trajectory(motion, seen, x + rng.normal(0, 1, 24), y + rng.normal(0, 1, 24))
        assert fit.error_px < 2.0
        fx, fy = fit.centre(ahead)
        tx, ty = paths.centre(motion, jitter, start + ahead)
        assert np.sqrt(np.mean((fx - tx) ** 2 + (fy - ty) ** 2)) < 5.0, (seed, fit)
        if motion == "bouncing":  # it lands where its own path meets the floor
            for t in fit.bounces(10.0):
                assert abs(fit.centre(np.array([t]))[1][0] - paths.BOUNCE_FLOOR) < 0.5
        else:
            assert fit.bounces(10.0).size == 0
    with pytest.raises(ValueError, match="one length"):
        nearest_trajectory(motion, np.arange(3), np.arange(3), np.arange(2))
    with pytest.raises(ValueError, match="unknown motion"):
        nearest_trajectory("spinning", np.arange(3), np.arange(3), np.arange(3))


def test_orbits_drawn_elsewhere_stay_in_the_frame_reach_a_picture_off_the_one_circle_and_are_fitted_as_drawn():
    """Jitter.from_seed's orbit_spread (issue 30's pictured orbit): 0 leaves every seed's world as it was; 1 draws
    every orbit about another centre at another radius, inside the frame; a circle through (80, 60), where the
    world's one circle never goes, is drawable; free_orbit fits a drawn orbit and continues it, while the one-circle
    fit cannot."""
    from world import motion as paths
    from world.fit import nearest_trajectory

    for seed in range(5):
        assert paths.Jitter.from_seed(seed, 0.0) == paths.Jitter.from_seed(seed)
    spread = [paths.Jitter.from_seed(seed, 1.0) for seed in range(200)]
    times = np.arange(64) / 16
    for jitter in spread:
        x, y = paths.centre("orbiting", jitter, times)
        assert paths.X_MIN - 1e-9 <= x.min() and x.max() <= paths.X_MAX + 1e-9
        assert paths.ORBIT_Y_MIN - 1e-9 <= y.min() and y.max() <= paths.ORBIT_Y_MAX + 1e-9
        assert paths.ORBIT_RADIUS_MIN <= jitter.orbit_radius <= paths.ORBIT_RADIUS
    # the same seed's other draws, so drifting and the rest are unchanged
    assert all((j.dx, j.dy, j.speed, j.phase) == (k.dx, k.dy, k.speed, k.phase)
               for j, k in zip(spread, (paths.Jitter.from_seed(seed) for seed in range(200))))
    through = [j for j in spread if abs(np.hypot(80 - 128 - j.orbit_dx, 60 - 72 - j.orbit_dy) - j.orbit_radius) < 4]
    assert through, "no drawn orbit passes within 4 px of (80, 60)"
    scene = Scene("circle", "red", "orbiting", "blue")
    assert not torch.equal(make_clip(scene, 7, 2).video, make_clip(scene, 7, 2, orbit_spread=1.0).video)
    assert torch.equal(make_clip(scene, 7, 2).video, make_clip(scene, 7, 2, orbit_spread=0.0).video)
    with pytest.raises(ValueError, match="orbit_spread"):
        paths.Jitter.from_seed(0, 1.5)

    rng = np.random.default_rng(9)
    for jitter in spread[:6]:
        start = rng.uniform(0, 3600)
        seen, ahead = np.arange(24) / 16, np.arange(24, 36) / 16
        x, y = paths.centre("orbiting", jitter, start + seen)
        noisy = x + rng.normal(0, 1, 24), y + rng.normal(0, 1, 24)
        fit = nearest_trajectory("orbiting", seen, *noisy, free_orbit=True)
        assert fit.error_px < 2.0, (jitter, fit)
        fx, fy = fit.centre(ahead)
        tx, ty = paths.centre("orbiting", jitter, start + ahead)
        assert np.sqrt(np.mean((fx - tx) ** 2 + (fy - ty) ** 2)) < 5.0, (jitter, fit)
    far = max(spread, key=lambda j: np.hypot(j.orbit_dx, j.orbit_dy))
    x, y = paths.centre("orbiting", far, np.arange(24) / 16)
    assert nearest_trajectory("orbiting", np.arange(24) / 16, x, y).error_px > 10.0  # the one circle is far from it


def test_sound_along_a_path_is_the_clips_own_sound_for_the_clips_path():
    """world.sound.features_along, given a clip's own path and landings, gives the clip's features (the long-rollout
    stage builds its sound targets with it from a fitted path)."""
    from world.motion import Jitter, bounce_times, centre

    clip = make_clip(Scene("circle", "red", "bouncing", "blue"), seed=3, latent_frames=12)
    jitter = Jitter.from_seed(3)
    scenes = clip.scenes
    count = clip.features.shape[1]
    for start in (0, 40, 100):
        along = sound.features_along(scenes, lambda t: centre("bouncing", jitter, t)[1], bounce_times("bouncing", jitter, 10.0),
                                     count - start, start_frame=start)
        torch.testing.assert_close(along, clip.features[:, start:])
