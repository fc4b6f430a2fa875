"""The spatial rotary base: the tables it gives, and the weights that name theirs (engine.models.rope, .trained)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from engine.models.rope import ROPE_THETA, FrameRotaryEmbedding
from engine.models.trained import TrainedWeights, rope_spatial_theta

HEAD_DIM, ROWS, COLS, FRAMES = 32, 9, 16, 8  # the tiny model's head and its 256x144 frame in tokens


def _angles(rope: FrameRotaryEmbedding) -> torch.Tensor:
    """Rotation angles [frames * tokens, head_dim / 2] (cos and sin of the tables give them back)."""
    cos, sin = rope.for_frames(FRAMES, "cpu")
    return torch.atan2(sin[:, 0].double(), cos[:, 0].double())


def _column_similarity(base: float, distance: int) -> float:
    """How alike two columns ``distance`` tokens apart look to the width axis's rotary pairs of the tables built
    with this base (mean cos of the pairs' angle differences, row 0 of frame 0)."""
    rope = FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, FRAMES, spatial_theta=base)
    pairs = HEAD_DIM // 6
    width = _angles(rope)[:COLS, -pairs:]  # frame 0, row 0: columns 0..COLS-1
    return float(torch.cos(width[distance] - width[0]).mean())


def test_the_default_base_is_wans_and_another_spatial_base_leaves_the_frame_axis_alone():
    wan = FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, FRAMES)
    same = FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, FRAMES, spatial_theta=ROPE_THETA)
    small = FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, FRAMES, spatial_theta=16.0)
    for a, b in zip(wan.for_frames(FRAMES, "cpu"), same.for_frames(FRAMES, "cpu")):
        assert torch.equal(a, b)
    t_pairs = (HEAD_DIM - 4 * (HEAD_DIM // 6)) // 2
    wan_angles, small_angles = _angles(wan), _angles(small)
    assert torch.equal(wan_angles[:, :t_pairs], small_angles[:, :t_pairs])  # frames: Wan's base still
    assert not torch.allclose(wan_angles[:, t_pairs:], small_angles[:, t_pairs:])
    # Column c of frame 0 turns pair i of the width axis by c * 16^(-i/5) (wrapped to -pi..pi).
    col = 5
    token = col  # frame 0, row 0
    w_angles = small_angles[token, t_pairs + 5:]
    expected = torch.tensor([col * 16.0 ** (-i / 5) for i in range(5)], dtype=torch.float64)
    torch.testing.assert_close(w_angles, torch.atan2(expected.sin(), expected.cos()), atol=1e-5, rtol=0)


def test_a_column_six_tokens_away_looks_like_a_neighbour_under_wans_base_and_not_under_the_tiny_models():
    """Why the base is the weights' to choose (docs/TINY_MODEL.md, *Pictures in everyday colours*): with Wan's 10000
    a 32-dim head's width pairs make a column 6 tokens (96 px) away as alike as the next one; base 16 does not."""
    assert _column_similarity(ROPE_THETA, 6) >= _column_similarity(ROPE_THETA, 1) - 0.01
    assert all(_column_similarity(16.0, d) < _column_similarity(16.0, 1) - 0.3 for d in range(3, COLS))


def test_weights_name_their_spatial_base_in_the_transformer_files_metadata(tmp_path):
    tensors = {"w": torch.zeros(1)}
    cases = {"wan": None, "small": {"rope_spatial_theta": "16.0"}, "word": {"rope_spatial_theta": "sixteen"},
             "low": {"rope_spatial_theta": "0.5"}}
    for name, metadata in cases.items():
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "transformer.safetensors"), metadata=metadata)
    assert TrainedWeights(tmp_path / "wan").rope_spatial_theta() == ROPE_THETA
    assert TrainedWeights(tmp_path / "small").rope_spatial_theta() == 16.0
    with pytest.raises(ValueError, match="rope_spatial_theta='sixteen' is not a number"):
        rope_spatial_theta(tmp_path / "word" / "transformer.safetensors")
    with pytest.raises(ValueError, match="must be above 1"):
        rope_spatial_theta(tmp_path / "low" / "transformer.safetensors")
    with pytest.raises(ValueError, match="must be above 1"):
        FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, FRAMES, spatial_theta=1.0)
