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

    def forward(self, x: torch.Tensor, state, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of input embeddings x (T, hidden). `positions` (3, T): the rope
        positions (t, h, w) of multimodal rope, for the architectures that have it; None: the
        state's next T positions."""
        hidden = self.config.hidden
        if x.dim() != 2 or x.shape[1] != hidden:
            raise PagelmError(f"forward: input of shape {tuple(x.shape)}, expected (T, {hidden})")
        T = x.shape[0]
        if state.pos + T > state.max_len:
            raise PagelmError(f"forward: pos {state.pos} + {T} tokens exceeds the state's max_len {state.max_len}")
        if positions is not None and tuple(positions.shape) != (3, T):
            raise PagelmError(f"forward: positions of shape {tuple(positions.shape)}, expected (3, {T})")
        if T == 0:
            return torch.empty(0, hidden, dtype=torch.float32, device=self.device)

        def segment(lo: int, hi: int) -> torch.Tensor:
            if positions is None:
                return self._forward(x[lo:hi], state)
            return self._forward(x[lo:hi], state, positions[:, lo:hi])

        with torch.inference_mode():
            if T <= self.segment:
                return segment(0, T)
            out = torch.empty(T, hidden, dtype=torch.float32, device=self.device)
            for lo in range(0, T, self.segment):
                out[lo : lo + self.segment] = segment(lo, lo + self.segment)
        return out

    __call__ = forward
