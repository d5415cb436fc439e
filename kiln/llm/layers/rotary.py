"""Rotary position embeddings (rotate-half convention) and their scalings:
Llama-3, linear (Gemma 3), LongRoPE (Phi-3); partial rotary (the first
`rotary_dim` dims of a head, Phi-4-mini)."""
from __future__ import annotations

import math

import torch

from kiln.llm.kernels import ops
from kiln.llm.models.arch import LinearRopeScaling, LongRopeScaling, RopeScaling, RopeVariant


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: RopeVariant | None, max_positions: int = 0
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, LongRopeScaling):
        long = max_positions > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64)
        return inv_freq / factors
    return _llama3(inv_freq, scaling)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Llama-3: long wavelengths are divided by `factor`, short ones kept,
    # the band between interpolated smoothly.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    cos: torch.Tensor  # [max_positions, rotary_dim/2] buffers
    sin: torch.Tensor

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: RopeVariant | None):
        super().__init__()
        inv_freq = inverse_frequencies(rotary_dim, theta, scaling, max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        # LongRoPE scales cos and sin (transformers' attention_scaling).
        gain = scaling.attention_factor if isinstance(scaling, LongRopeScaling) else 1.0
        self.register_buffer("cos", (angles.cos() * gain).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * gain).float(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` ([T]), shaped [T, 1, rotary_dim/2]; looked
        up once per forward pass and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D]; rotates the first 2 * cos.shape[-1]
        dims of each head. The fused kernel rotates them in place (they are
        views of a temporary qkv projection)."""
        rotary_dim = 2 * cos.shape[-1]
        if rotary_dim < q.shape[-1]:
            # Kiln's CPU kernel takes the strided views; the Triton one is not checked on them.
            if q.device.type == "cpu" and ops.rotary_(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin):
                return q, k
            return _rotate_partial(q, cos, sin, rotary_dim), _rotate_partial(k, cos, sin, rotary_dim)
        if ops.rotary_(q, k, cos, sin):
            return q, k
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        return _rotate(x.float(), cos, sin).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
