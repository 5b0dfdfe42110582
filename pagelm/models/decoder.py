"""What every decoder stack shares: input checks, inference mode and long prompts cut into
segments. Owns no model math: each architecture implements `_forward(x, state)` for one segment."""

from __future__ import annotations

import torch

from pagelm.errors import PagelmError


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Decoder:
    """Base of the architecture models: needs `config.hidden`, `device`, `segment` and `_forward`."""

    segment: int

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
