"""A diffusers ``WanTransformer3DModel`` run block-causally over paged KV.

The modules (patch embedding, condition embedder, transformer blocks, output
norm and projection) are diffusers' own; what this file owns is the forward:
per-frame timesteps, rotary positions that start where the history ends, and
attention processors that read the session's cache. Model code never sees
sessions, sockets or queues: it gets tensors and an attention context (``engine/models/attention.py``).
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.activations import GELU

from engine.models import fp8_attention as fa
from engine.models import norm_quantize
from engine.models.audio_tokens import AudioTokenProjections
from engine.models.attention import (
    CachedCrossAttentionProcessor,
    AttentionContext,
    PagedSelfAttentionProcessor,
    project_cross_kv,
)
from engine.models.fp8_linear import FP8Linear
from engine.models.kernels import Kernels
from engine.models.latents import BlockLatents
from engine.models.rope import ROPE_THETA, FrameRotaryEmbedding


class CausalWanTransformer(torch.nn.Module):
    """Block-causal forward of a Wan2.1-family DiT at one frame size."""

    def __init__(
        self,
        transformer: WanTransformer3DModel,
        *,
        latent_height: int,
        latent_width: int,
        audio: AudioTokenProjections | None = None,
        fused_kernels: bool | None = None,
        fp8_attention: bool = False,
        exact_kernels: bool = True,
        rope_spatial_theta: float = ROPE_THETA,
    ) -> None:
        """``rope_spatial_theta``: the rotary base of the rows and columns, the one the weights were trained with
        (``engine.models.trained.rope_spatial_theta``; Wan's 10000 unless they say otherwise).
        ``fused_kernels``: run the elementwise work through compiled kernels (default: on CUDA).
        ``exact_kernels=False``: also the fused steps that round differently from eager (``Kernels.make``).
        ``fp8_attention``: self-attention through the FP8 kernel (docs/FP8.md); needs a bf16 model on a Hopper
        GPU (or the Triton interpreter on the CPU, for tests) and a pipeline that gathers history once per block."""
        super().__init__()
        config = transformer.config
        p_t, p_h, p_w = config.patch_size
        if p_t != 1:
            raise ValueError("causal streaming needs a temporal patch size of 1 (one latent frame per KV block)")
        if latent_height % p_h or latent_width % p_w:
            raise ValueError(f"latent {latent_height}x{latent_width} is not divisible by the patch {p_h}x{p_w}")
        if config.image_dim is not None or config.added_kv_proj_dim is not None:
            raise ValueError("image-conditioned Wan variants are not supported by the causal pipeline")
        if fp8_attention:
            fa.check_engine_support(
                transformer.patch_embedding.weight.device, transformer.patch_embedding.weight.dtype,
                config.attention_head_dim,
            )
        self.fp8_attention = fp8_attention
        self.transformer = transformer
        if fused_kernels is None:
            fused_kernels = transformer.patch_embedding.weight.is_cuda
        self.exact_kernels = exact_kernels
        self.kernels = Kernels.make(fused_kernels, exact=exact_kernels)
        self.engine_kernels = self.kernels  # the set it was built with (benchmarks swap self.kernels)
        self.patch_rows = latent_height // p_h
        self.patch_cols = latent_width // p_w
        self.num_layers = len(transformer.blocks)
        self.num_heads = config.num_attention_heads
        self.head_dim = config.attention_head_dim
        self.inner_dim = self.num_heads * self.head_dim
        self.audio = audio
        self.audio_tokens_per_frame = audio.tokens_per_frame if audio is not None else 0
        self.use_rope_spatial_theta(rope_spatial_theta)
        for index, block in enumerate(transformer.blocks):
            block.attn1.set_processor(PagedSelfAttentionProcessor(index, fp8_attention=fp8_attention))
            block.attn2.set_processor(CachedCrossAttentionProcessor(index))

    def use_rope_spatial_theta(self, theta: float) -> None:
        """Rotary tables of this spatial base (weights trained with another one loaded in place: before the first
        forward, whose graphs and history loads would keep the old tables)."""
        self.rope = FrameRotaryEmbedding(
            self.head_dim,
            self.patch_rows,
            self.patch_cols,
            self.transformer.config.rope_max_seq_len,
            audio_tokens=self.audio_tokens_per_frame,
            spatial_theta=theta,
        )

    @property
    def video_tokens_per_frame(self) -> int:
        return self.patch_rows * self.patch_cols

    @property
    def tokens_per_frame(self) -> int:
        """Tokens of one latent frame: its image patches, then its audio latent frames."""
        return self.video_tokens_per_frame + self.audio_tokens_per_frame

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.patch_embedding.weight.device

    @torch.no_grad()
    def project_text(self, text_embeddings: torch.Tensor) -> torch.Tensor:
        """Per-layer text K/V: ``[B, layers, 2, text_len, heads, head_dim]`` from ``[B, text_len, text_dim]``."""
        states = self.transformer.condition_embedder.text_embedder(text_embeddings.to(self.device, self.dtype))
        layers = [torch.stack(project_cross_kv(block.attn2, states), dim=1) for block in self.transformer.blocks]
        return torch.stack(layers, dim=1)

    def rotary(self, num_key_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.for_frames(num_key_frames, self.device)

    @torch.no_grad()
    def forward(
        self,
        latents: BlockLatents,
        frame_timesteps: torch.Tensor,
        context: AttentionContext,
        cross_kv: torch.Tensor,
    ) -> BlockLatents:
        """Predict the flow for ``latents`` (video ``[B, C, F, h, w]``, audio ``[B, D, F*A]``) at one timestep per frame.

        Every token of a frame gets that frame's timestep (the per-token
        timestep of diffusers' Wan2.2 path, computed once per frame).
        """
        model = self.transformer
        video = latents.video
        batch, _, frames, height, width = video.shape
        p_t, p_h, p_w = model.config.patch_size
        rows, cols = height // p_h, width // p_w
        if (rows, cols) != (self.patch_rows, self.patch_cols):
            raise ValueError(f"latent size {height}x{width} does not match the model's {self.patch_rows * p_h}x{self.patch_cols * p_w}")
        if (latents.audio is None) != (self.audio is None):
            raise ValueError("audio latents must be given exactly when the model has audio tokens")
        video_tokens = rows * cols
        hidden = model.patch_embedding(video.to(self.dtype)).flatten(2).transpose(1, 2)
        if self.audio is not None:
            audio_tokens = self.audio.tokens(latents.audio.to(self.dtype), frames)
            hidden = torch.cat([hidden.view(batch, frames, video_tokens, -1), audio_tokens], dim=2).flatten(1, 2)
        hidden = hidden.contiguous()
        tokens = self.tokens_per_frame

        embedder = model.condition_embedder
        t_freq = embedder.timesteps_proj(frame_timesteps.reshape(-1).float())
        time_dtype = next(iter(embedder.time_embedder.parameters())).dtype
        temb = embedder.time_embedder(t_freq.to(time_dtype)).to(hidden.dtype)  # [B*F, dim]
        modulation = embedder.time_proj(embedder.act_fn(temb)).view(batch, frames, 1, 6, self.inner_dim)
        temb = temb.view(batch, frames, 1, self.inner_dim)

        for block in model.blocks:
            hidden = _run_block(block, hidden, modulation, context, cross_kv, self.kernels)

        shift, scale = (model.scale_shift_table.view(1, 1, 2, -1) + temb).chunk(2, dim=2)  # [B, F, 1, dim]
        normed = model.norm_out(hidden.float()).view(batch, frames, tokens, -1)
        hidden = (normed * (1 + scale) + shift).type_as(hidden)
        out_video = model.proj_out(hidden[:, :, :video_tokens].flatten(1, 2))
        out_video = out_video.reshape(batch, frames, rows, cols, p_t, p_h, p_w, -1)
        out_video = out_video.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        out_audio = None
        if self.audio is not None:
            out_audio = self.audio.latents(hidden[:, :, video_tokens:])
        return BlockLatents(out_video, out_audio)


def _run_block(block, hidden, modulation, context, cross_kv, kernels: Kernels):
    """diffusers' ``WanTransformerBlock.forward`` with modulation broadcast per frame, not per token.

    Same arithmetic as the per-token path (each token gets its frame's values),
    without materialising ``[tokens, 6, dim]`` per layer. The elementwise runs
    between the matrix products go through ``kernels`` (fused on CUDA).
    """
    dim = hidden.shape[-1]
    mod = (block.scale_shift_table.view(1, 1, 6, dim) + modulation.float()).squeeze(2)  # [B, F, 6, dim]
    shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = (m.unsqueeze(2) for m in mod.unbind(2))
    if kernels.quantized_norms and norm_quantize.takes_quantized_inputs(block):
        return _run_block_quantized_norms(block, hidden, mod, context, cross_kv, kernels)

    normed = kernels.modulated_layer_norm(hidden, scale_msa, shift_msa, block.norm1.eps)
    attn_out = block.attn1(normed, context=context, kernels=kernels)
    hidden = kernels.gated_residual(hidden, attn_out, gate_msa)

    norm2 = block.norm2
    if isinstance(norm2, torch.nn.LayerNorm):
        normed = kernels.affine_layer_norm(hidden, norm2.weight, norm2.bias, norm2.eps)
    else:  # cross_attn_norm=False: diffusers' Identity
        normed = hidden
    cross_out = block.attn2(normed, cross_kv=cross_kv, kernels=kernels)
    hidden, normed = kernels.residual_modulated_layer_norm(hidden, cross_out, c_scale, c_shift, block.norm3.eps)

    return kernels.gated_residual(hidden, _feed_forward(block.ffn, normed, kernels), c_gate)


def _run_block_quantized_norms(block, hidden, mod, context, cross_kv, kernels: Kernels):
    """:func:`_run_block` for a block whose norms feed FP8 products only (``--fp8 linear | all``): each norm, with
    the residual before it, writes its products' e4m3 rows directly (:mod:`engine.models.norm_quantize`), so no
    normalized bf16 activation is written and read back. Within an e4m3 step of :func:`_run_block`'s."""
    shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = (m.unsqueeze(2) for m in mod.unbind(2))
    _, rows = norm_quantize.norm_quantize(hidden, block.norm1.eps, scale=scale_msa, shift=shift_msa)
    attn_out = block.attn1(rows, context=context, kernels=kernels)
    norm2 = block.norm2
    hidden, rows = norm_quantize.norm_quantize(hidden, norm2.eps, update=attn_out, gate=gate_msa,
                                               weight=norm2.weight, bias=norm2.bias)
    cross_out = block.attn2(rows, cross_kv=cross_kv, kernels=kernels)
    hidden, rows = norm_quantize.norm_quantize(hidden, block.norm3.eps, update=cross_out, scale=c_scale,
                                               shift=c_shift)
    ffn = block.ffn
    return kernels.gated_residual(hidden, ffn.net[2].forward_gelu(ffn.net[0].proj(rows)), c_gate)


def _feed_forward(ffn, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    """diffusers' ``FeedForward`` (``GELU(tanh)`` projection, dropout, linear), its first half through
    ``kernels.gelu_linear``; with both products FP8, the GELU inside the second one's input quantizer
    (:meth:`FP8Linear.forward_gelu`); any other layout (another activation, training) runs the module."""
    act = ffn.net[0]
    if not (
        len(ffn.net) == 3
        and isinstance(act, GELU)
        and act.approximate == "tanh"
        and isinstance(ffn.net[1], torch.nn.Dropout)
        and not ffn.training
    ):
        return ffn(x)
    if type(act.proj) is torch.nn.Linear:
        return ffn.net[2](kernels.gelu_linear(x, act.proj.weight, act.proj.bias))
    if type(act.proj) is FP8Linear and type(ffn.net[2]) is FP8Linear:
        return ffn.net[2].forward_gelu(act.proj(x))
    return ffn(x)
