"""The arguments of an attention problem beside q, k, v as every kernel family reads them (Triton, Gluon, decode):
the scalars (AttnParams), a block mask's tile lists (SparseLists), the user mods compiled in (UserMods), the running
sums a backward adds into (GradSums); the kernels' constexpr groups of features (Features, Flex).

The mask is a window (left, right) aligned to the bottom-right corner (flash-attn 2.x): query i may see key j iff
i + sk - sq - left <= j <= i + sk - sq + right, -1 meaning unbounded on that side; causal is (-1, 0). What a kernel
derives from it (causal or not, which window edges apply) is derived here, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

LOG2E = 1.4426950408889634   # log2(e): the kernels compute exp(x) as exp2(x * log2 e)
LN2 = 0.6931471805599453     # ln(2): a log2-sum-exp times ln 2 is the natural-log LSE
# log2(448), of e4m3's largest finite value: the FP8 forward's P~ = exp2(S - m + log2 448) fills e4m3's range
LOG2_E4M3_MAX = 8.807354922057604


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


class Features(NamedTuple):
    """The problem's features a kernel compiles in: one constexpr, so a problem without a feature compiles none of
    its code (the Triton launchers' and fa3.fwd_features / bwd_features derive them from the problem and the
    kernel's tiles; a kernel reads the fields it knows)."""
    VARLEN: bool = False      # packed sequences: bounds from cu_seqlens
    HAS_LEFT: bool = False    # a window's left edge (AttnParams.has_left)
    HAS_RIGHT: bool = False   # its right edge (causal: right = 0)
    SOFTCAP: bool = False
    ALIBI: bool = False
    TAIL: bool = False        # a sequence may end inside a tile
    GUARD: bool = False       # forward: a row may see no key (output 0, LSE -inf)
    SKIP: bool = False        # backward: a query block may see none of a consumer warpgroup's keys
    EMPTY: bool = False       # backward: a row may have seen no key (L = -inf)
    DROPOUT: bool = False     # dropout on P (the Triton kernels; the Gluon kernels take none)
    SAME_SEQS: bool = False   # VARLEN: queries and keys are the same sequences (one cu_seqlens tensor)
    MASK_EVERY_STEP: bool = False   # backward: P masked on every step, not only where some pair is hidden


class Flex(NamedTuple):
    """flashtile.flex's features a kernel compiles in (one constexpr): the user's @triton.jit mods (None: absent;
    the derivatives backward only), attn_bias / a bool mask present, a block mask's block size (0: none)."""
    SCORE_MOD: object = None
    MASK_MOD: object = None
    HAS_BIAS: bool = False
    HAS_MASK: bool = False
    SPARSE_BLOCK: int = 0
    SCORE_GRAD: object = None
    SCORE_CAPTURED_GRAD: object = None


@dataclass(frozen=True)
class SparseLists:
    """A block mask's tile lists (int32, contiguous; batch/head dimensions of size 1 broadcast):
    kv_num/full_kv_num (B, H, n_q_blocks), kv_idx/full_kv_idx (B, H, n_q_blocks, n_kv_blocks): per query block,
    the key blocks that are partial / full; q_* the transpose (per key block, its query blocks)."""
    block_size: int
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    full_kv_num: torch.Tensor
    full_kv_idx: torch.Tensor
    q_num: torch.Tensor
    q_idx: torch.Tensor
    full_q_num: torch.Tensor
    full_q_idx: torch.Tensor


class GradSums(NamedTuple):
    """float32 running sums a backward adds its gradients into instead of returning them (the ring's steps: each
    shard's gradients summed over the blocks it meets, in float32): dq (q's shape), dk, dv (k's shape); delta =
    rowsum(dO o O) (lse's shape and strides) where the caller computed it once for several calls over the same rows
    (the ring's steps), else None (computed per call); kv_f32, kv_fresh: below."""
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    delta: Optional[torch.Tensor] = None
    # dK, dV leave the Gluon kernel in float32 (no 16-bit rounding of a partial sum), else in q's dtype before they
    # are added (a cheaper epilogue: the varlen ring's many short key blocks, `git log -S kv_f32`)
    kv_f32: bool = True
    # dk / dv hold nothing yet: this call, over every one of their rows, writes dK / dV instead of adding (a ring
    # step's first call: no zero-filled accumulator)
    kv_fresh: bool = False


@dataclass(frozen=True)
class UserMods:
    """flashtile.flex's modifiers, compiled into the kernels: @triton.jit functions (None: absent) and the
    tuples of values they capture (tensors arrive in the kernels as pointers, ints / floats as scalars).
    score_aux_grad: parallel to score_aux, a float32 zero buffer in place of each captured tensor (score_captured_grad
    adds into it), the captured int / float itself elsewhere; backward only, and only when a captured tensor wants
    a gradient (else None, and score_captured_grad None)."""
    score_mod: object = None
    score_grad: object = None
    score_captured_grad: object = None
    score_aux: Optional[tuple] = None
    mask_mod: object = None
    mask_aux: Optional[tuple] = None
    score_aux_grad: Optional[tuple] = None

    def kernel_kwargs(self, kernel: str) -> dict:
        """The Triton kernels' keyword arguments for the captured values: attn_fwd_kernel's ("fwd"),
        attn_bwd_dq_kernel's ("dq"), attn_bwd_dkdv_kernel's ("dkdv", with the gradient buffers)."""
        kw = dict(score_aux=self.score_aux, mask_aux=self.mask_aux)
        if kernel == "dkdv":
            kw["score_aux_grad"] = self.score_aux_grad
        return kw

    def flex_fields(self, kernel: str) -> dict:
        """Flex's fields of the mods for a kernel: the mods; the score_mod's derivative in a backward kernel ("dq",
        "dkdv"); its captured tensors' gradient in the one that adds it ("dkdv": the Triton dK / dV kernel, the
        Gluon backward)."""
        return dict(SCORE_MOD=self.score_mod, MASK_MOD=self.mask_mod,
                    SCORE_GRAD=self.score_grad if kernel != "fwd" else None,
                    SCORE_CAPTURED_GRAD=self.score_captured_grad if kernel == "dkdv" else None)
