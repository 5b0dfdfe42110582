"""Rope scalings computed from a config's numbers rather than stored: Llama 3.1's per-pair frequency
factors (GGUF files carry them as `rope_freqs.weight`; a Hugging Face config carries only the
numbers). Plain Python, no torch: the synthetic-model writer uses it too."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Llama3Scaling:
    """`rope_scaling` of type llama3: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: float

    def factors(self, base: float, head_dim: int) -> tuple[float, ...]:
        """Per rope pair, the divisor of its frequency, as llama.cpp's converter computes
        rope_freqs (and as transformers scales the frequencies): 1 for short wavelengths, `factor`
        for long ones, a smooth blend between."""
        low_wavelen = self.original_context / self.low_freq_factor
        high_wavelen = self.original_context / self.high_freq_factor
        out = []
        for j in range(0, head_dim, 2):
            wavelen = 2 * math.pi * base ** (j / head_dim)
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(self.factor)
            else:
                smooth = (self.original_context / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor)
                out.append(1 / ((1 - smooth) / self.factor + smooth))
        return tuple(out)


@dataclass(frozen=True)
class YarnScaling:
    """`rope_scaling` of type yarn (gpt-oss): each rope pair's frequency a blend, by a linear ramp over
    the pairs, of the extrapolated base frequency and the interpolated one (divided by `factor`), and
    cos and sin multiplied by `attention_factor`, as transformers' `_compute_yarn_parameters`.
    `truncate`: the ramp's ends rounded out to whole pairs (transformers' default; gpt-oss's config
    says false)."""

    factor: float
    original_context: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = False

    @property
    def attention_factor(self) -> float:
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def ramp_ends(self, base: float, head_dim: int) -> tuple[float, float]:
        """(low, high): the pair indices between which the ramp rises from 0 to 1."""

        def pair(rotations: float) -> float:
            return head_dim * math.log(self.original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = pair(self.beta_fast), pair(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)
