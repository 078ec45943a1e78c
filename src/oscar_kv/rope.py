"""Position-aware key centering.

A biased k_proj (Qwen2 / Qwen2.5) adds a large constant to every pre-RoPE key.  RoPE turns that
constant into RoPE_p(b): in each channel pair a sinusoid of the position whose amplitude is |b|.
A constant post-RoPE mean cannot remove it, so it fills the INT2 range and the keys' real content
drowns.  With ``key_centering="rope"`` the cache stores k_p - RoPE_p(mu_pre) (mu_pre: the calibrated
mean pre-RoPE key) and attention adds q . RoPE_p(mu_pre) back exactly; unlike a constant offset it
depends on the key's position, so it does not cancel in softmax.

The model's own rotary module supplies cos/sin, so any RoPE variant transformers implements (scaled,
YaRN, Llama-3) is reproduced bit for bit.  RoPE in the rotate-half layout over the full head dim is
required; other layouts are refused.
"""

from __future__ import annotations

import torch


class RopeUnsupported(ValueError):
    pass


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def remove_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of ``apply_rope`` (rotation by minus the angle)."""
    return x * cos - rotate_half(x) * sin


def key_offsets(mu_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE_p(mu_pre) for every position: mu_pre [H, D], cos/sin [T, D] -> [H, T, D]."""
    return apply_rope(mu_pre[:, None, :].float(), cos, sin)


def find_rotary(model):
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        raise RopeUnsupported(f"{type(model).__name__} has no rotary embedding module; position-aware key "
                              "centering needs one (use --key-centering constant)")
    return rotary


class RopeTable:
    """float32 cos/sin of the model's rotary embedding by position, grown on demand, shared by all layers."""

    def __init__(self, model, head_dim: int):
        self.rotary, self.head_dim = find_rotary(model), head_dim
        self.cos = self.sin = None
        self._packed = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] float32 for ``positions`` [T] (on the positions' device)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if self.cos is None or self.cos.shape[0] < need:
            self._grow(max(need, 2 * (0 if self.cos is None else self.cos.shape[0]), 1024))
        idx = positions.to(self.cos.device)
        return self.cos[idx].to(positions.device), self.sin[idx].to(positions.device)

    def packed(self, n: int, device) -> torch.Tensor:
        """The kernels' table: float32 [>= n, D], cos | sin of the first D/2 channels (the rotate-half layout
        repeats them in the second half)."""
        if self._packed is None or self._packed.shape[0] < n or self._packed.device != torch.device(device):
            if self.cos is None or self.cos.shape[0] < n:
                self(torch.tensor([max(n - 1, 0)]))
            half = self.head_dim // 2
            if not (torch.equal(self.cos[:, :half], self.cos[:, half:]) and
                    torch.equal(self.sin[:, :half], self.sin[:, half:])):
                raise RopeUnsupported("the rotary embedding is not in the rotate-half layout")
            self._packed = torch.cat([self.cos[:, :half], self.sin[:, :half]], 1).to(device).contiguous()
        return self._packed

    @torch.no_grad()
    def _grow(self, n: int) -> None:
        device = next(self.rotary.buffers()).device
        probe = torch.zeros(1, 1, device=device, dtype=torch.float32)
        cos, sin = self.rotary(probe, torch.arange(n, device=device)[None])
        if cos.shape[-1] != self.head_dim:
            raise RopeUnsupported(f"the rotary embedding covers {cos.shape[-1]} of {self.head_dim} channels; "
                                  "position-aware key centering needs full-dimension RoPE")
        self.cos, self.sin = cos[0].float(), sin[0].float()
