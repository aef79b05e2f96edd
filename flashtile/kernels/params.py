"""The scalar parameters of an attention problem as every kernel family reads them (Triton, Gluon, decode).

The mask is a window (left, right) aligned to the bottom-right corner (flash-attn 2.x): query i may see key j iff
i + sk - sq - left <= j <= i + sk - sq + right, -1 meaning unbounded on that side; causal is (-1, 0). What a kernel
derives from it (causal or not, which window edges apply) is derived here, once.
"""
from __future__ import annotations

from dataclasses import dataclass

LOG2E = 1.4426950408889634   # log2(e): the kernels compute exp(x) as exp2(x * log2 e)


@dataclass(frozen=True)
class AttnParams:
    """Everything about an attention call that is not a tensor (validated and normalised)."""
    softmax_scale: float
    window_left: int = -1        # -1: unbounded
    window_right: int = -1       # -1: unbounded; causal is window_right = 0
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: int = 0                # dropout's Philox key and counter offset (per call)
    rng_offset: int = 0

    @property
    def has_left(self) -> bool:
        """Keys left of the window (more than window_left before the diagonal) are masked."""
        return self.window_left >= 0

    @property
    def has_right(self) -> bool:
        """Keys right of the window (more than window_right after the diagonal) are masked."""
        return self.window_right >= 0

    @property
    def lower_triangular(self) -> bool:
        """No key after the diagonal is visible (causal, with or without a left window): tiles past the diagonal
        are skipped, and work per query tile grows with its index."""
        return self.window_right == 0

    @property
    def is_causal(self) -> bool:
        """flash-attn's causal: every key up to the diagonal, no left window."""
        return self.window_right == 0 and self.window_left < 0

    @property
    def is_local(self) -> bool:
        """A window other than plain causal (sliding window, or a right window > 0)."""
        return (self.window_left >= 0 or self.window_right >= 0) and not self.is_causal

    def score_args(self):
        """(score_scale, softcap_log2) as mods.scores_log2 expects them."""
        if self.softcap > 0:
            return self.softmax_scale / self.softcap, self.softcap * LOG2E
        return self.softmax_scale * LOG2E, 0.0
