"""Random weights for tests and benchmarks, shared by every codec's decoder (``from_config``).

One rule for the common layers, so that random audio is neither silent nor saturated: weights
uniform with std ``gain / sqrt(fan_in)``, so activations keep their scale through the stack;
biases small; norms and Snake α near their trained ranges. A decoder then rescales the parts
of its own architecture that need it (its second pass). Every value is drawn from one
generator, module by module in ``model.modules()`` order, weight before bias, so a seed gives
the same weights in every process (same torch version).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .modules import Snake1d


class WeightDraw:
    """Fills tensors in place from one ``torch.Generator``."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def uniform(self, t: torch.Tensor, low: float, high: float) -> None:
        t.uniform_(low, high, generator=self.gen)

    def fan_in(self, t: torch.Tensor, fan_in: float, gain: float = 1.0) -> None:
        """Uniform with std ``gain / sqrt(fan_in)``."""
        bound = gain * math.sqrt(3.0 / fan_in)
        self.uniform(t, -bound, bound)


def seeded(seed: int | None) -> torch.Generator:
    """A generator from ``seed``; None draws the seed from torch's global generator."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def init_common_layers(model: nn.Module, draw: WeightDraw) -> None:
    """The generic rule (module docstring) for embeddings, convolutions, linear layers, layer
    norms and Snake activations; other modules are left to the caller."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, 1.0, generator=draw.gen)
        elif isinstance(module, nn.ConvTranspose1d):
            in_ch, _, k = module.weight.shape
            draw.fan_in(module.weight, in_ch * k / module.stride[0])
        elif isinstance(module, (nn.Conv1d, nn.Linear)):
            draw.fan_in(module.weight, module.weight[0].numel())
        elif isinstance(module, nn.LayerNorm):
            draw.uniform(module.weight, 0.8, 1.2)
            draw.uniform(module.bias, -0.1, 0.1)
        elif isinstance(module, Snake1d):
            draw.uniform(module.alpha, 0.5, 1.5)
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)) and module.bias is not None:
            draw.uniform(module.bias, -0.05, 0.05)
