"""What every decoder stack shares: input checks, inference mode, long prompts cut into segments,
moving weights to the device, and the bytes the weights hold. Owns no model math: each
architecture implements `_forward(x, state)` for one segment."""

from __future__ import annotations

import torch

from pagelm.errors import PagelmError


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Decoder:
    """Base of the architecture models: needs `config.hidden`, `device`, `segment`, `layers`
    (each with `tensors()`), `output_norm` and `_forward`."""

    segment: int

    def _to_device(self, layer):
        if self.device.type != "cpu":
            for name, value in vars(layer).items():
                setattr(layer, name, value.to(self.device))
        return layer

    @property
    def nbytes(self) -> int:
        """Bytes of the dequantized layer weights (and output_norm) this model holds."""
        return nbytes(t for layer in self.layers for t in layer.tensors()) + nbytes([self.output_norm])

    def forward(self, x: torch.Tensor, state) -> torch.Tensor:
        hidden = self.config.hidden
        if x.dim() != 2 or x.shape[1] != hidden:
            raise PagelmError(f"forward: input of shape {tuple(x.shape)}, expected (T, {hidden})")
        T = x.shape[0]
        if state.pos + T > state.max_len:
            raise PagelmError(f"forward: pos {state.pos} + {T} tokens exceeds the state's max_len {state.max_len}")
        if T == 0:
            return torch.empty(0, hidden, dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            if T <= self.segment:
                return self._forward(x, state)
            out = torch.empty(T, hidden, dtype=torch.float32, device=self.device)
            for lo in range(0, T, self.segment):
                out[lo : lo + self.segment] = self._forward(x[lo : lo + self.segment], state)
        return out

    __call__ = forward
