"""The naive reference path: whole-sequence forwards with a block-causal mask.

No cache at all: every forward re-runs the clean history at t = 0 next to the
block being denoised. Slow, obviously right, and the thing the paged path is
tested against (they must agree until the window first evicts).
"""

from __future__ import annotations

import torch

from engine.models.attention import DenseContext
from engine.models.causal_wan import CausalWanTransformer
from engine.models.latents import BlockLatents
from engine.models.pipeline import draw_noise


def block_causal_mask(num_frames: int, frames_per_block: int, tokens_per_frame: int, device) -> torch.Tensor:
    """``[S, S]`` bool: token i may attend to token j iff j's block is not after i's."""
    block_of_token = torch.arange(num_frames, device=device).repeat_interleave(tokens_per_frame) // frames_per_block
    return block_of_token.unsqueeze(1) >= block_of_token.unsqueeze(0)


@torch.no_grad()
def full_sequence_flow(
    transformer: CausalWanTransformer,
    latents: BlockLatents,
    frame_timesteps: torch.Tensor,
    frames_per_block: int,
    text_embeddings: torch.Tensor,
) -> BlockLatents:
    """One forward over every frame, absolute positions 0..N-1, block-causal attention."""
    num_frames = latents.frames
    cos, sin = transformer.rotary(num_frames)
    mask = block_causal_mask(num_frames, frames_per_block, transformer.tokens_per_frame, transformer.device)
    context = DenseContext(cos=cos, sin=sin, attn_mask=mask)
    cross_kv = transformer.project_text(text_embeddings)[0]
    return transformer(latents.to(transformer.device), frame_timesteps.to(transformer.device), context, cross_kv)


@torch.no_grad()
def reference_generate(
    transformer: CausalWanTransformer,
    text_embeddings: torch.Tensor,
    *,
    num_blocks: int,
    seed: int,
    sigmas: list[float],
    latent_shape: tuple[int, ...],
    audio_shape: tuple[int, ...] | None = None,
) -> list[BlockLatents]:
    """Clean latents of ``num_blocks`` blocks, drawing noise in the same order as the pipeline."""
    generator = torch.Generator().manual_seed(seed)
    frames = latent_shape[2]
    device = transformer.device
    clean_blocks: list[BlockLatents] = []
    for _ in range(num_blocks):
        x = draw_noise(generator, latent_shape, audio_shape, device)
        history = len(clean_blocks) * frames
        for index, sigma in enumerate(sigmas):
            sequence = BlockLatents.cat(clean_blocks + [x])
            timesteps = torch.cat([torch.zeros(history), torch.full((frames,), 1000.0 * sigma)]).unsqueeze(0)
            flow = full_sequence_flow(transformer, sequence, timesteps, frames, text_embeddings).float()
            flow = BlockLatents.cat(flow.split_frames()[-frames:])
            clean = x.combine(flow, 1.0, -sigma)
            if index + 1 < len(sigmas):
                next_sigma = sigmas[index + 1]
                x = clean.combine(draw_noise(generator, latent_shape, audio_shape, device), 1.0 - next_sigma, next_sigma)
        clean_blocks.append(clean)
    return clean_blocks
