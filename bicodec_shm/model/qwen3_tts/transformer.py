"""The 12 Hz tokenizer's ``pre_transformer``: a causal transformer with sliding-window attention
over the frames (qwen-tts's ``Qwen3TTSTokenizerV2DecoderTransformerModel``).

``input_proj`` (latent -> hidden), ``num_hidden_layers`` pre-norm layers (RMSNorm, attention with
RoPE, layer scale; RMSNorm, SwiGLU MLP, layer scale), a final RMSNorm, ``output_proj`` back to the
latent. Query ``t`` attends to keys ``t - window + 1 .. t`` (transformers' sliding-window causal
mask: ``window`` keys, itself included), so a right-padded row's frames see only its own frames.
Positions count from 0 in every forward pass, as upstream's (each decode chunk starts at 0).
Parameter names follow upstream, so a published state dict loads as is. Shapes: ``B`` batch,
``T`` frames, ``H`` hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3CodecConfig


class RMSNorm(nn.Module):
    """``weight · x / sqrt(mean(x²) + eps)``, the statistic in float32 (as upstream's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class LayerScale(nn.Module):
    """A learnt per-channel ``scale`` of a residual branch."""

    def __init__(self, dim: int, initial: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Attention(nn.Module):
    """``self_attn``: multi-head attention (grouped key/value heads allowed), RoPE on queries and
    keys, no q/k norm."""

    def __init__(self, cfg: Qwen3CodecConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.heads_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """x (B, T, H), cos/sin (T, head_dim), allowed (T, T) bool -> (B, T, H)"""
        batch, frames, _ = x.shape
        q = self.q_proj(x).view(batch, frames, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, frames, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, frames, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:  # key/value head h serves query heads h·g .. h·g + g - 1
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, frames, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Mlp(nn.Module):
    """``mlp``: ``down_proj(silu(gate_proj(x)) · up_proj(x))``, no biases."""

    def __init__(self, cfg: Qwen3CodecConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Qwen3CodecConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(h, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(h, cfg.layer_scale_initial_scale)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, allowed))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """``pre_transformer``: (B, T, latent) -> (B, T, latent)."""

    def __init__(self, cfg: Qwen3CodecConfig) -> None:
        super().__init__()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.head_dim, self.theta = cfg.heads_dim, cfg.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[1]
        h = self.input_proj(x)
        steps = torch.arange(frames, device=x.device)
        # transformers' default RoPE, theta^(-2i/d), in float32 whatever the model's dtype (a
        # buffer would be cast with the model)
        exponent = (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=x.device).float() / self.head_dim
        )
        inv_freq = 1.0 / (self.theta**exponent)
        # an outer product of one term per entry: the same float32 values as upstream's matmul
        freqs = steps.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        behind = steps[:, None] - steps[None, :]  # query minus key
        allowed = (behind >= 0) & (behind < self.window)  # causal, the last `window` keys
        for layer in self.layers:
            h = layer(h, cos, sin, allowed)
        return self.output_proj(self.norm(h))
