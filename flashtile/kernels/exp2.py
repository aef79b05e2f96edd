"""exp2 on the FMA units for part of a softmax tile (FlashAttention-4's trick, here for Hopper's FP8 forward).

An SM evaluates 16 exponentials per clock on its MUFU units but 128 fused multiply-adds. With FP8 the tensor cores
double their rate and the 16384 exponentials of a 128 x 128 score tile take about as long as its two GEMMs
(seed 001 §3.1), so some of them are computed instead as

    2^x = 2^j * 2^f,   j = floor(x),  f = x - j in [0, 1),   2^f ~ p(f) = 1 + c1 f + c2 f^2 + c3 f^3

with j found by the 1.5 * 2^23 rounding trick (one add rounding toward -inf leaves j in the low mantissa bits; no
conversion instruction, which would run at the MUFU's rate) and 2^j applied by adding j << 23 to p's exponent
bits. p is the degree-3 minimax polynomial for the relative error on [0, 1) with p(0) = 1: |p(f) / 2^f - 1| <=
8.6e-5 (2^-13.5), below bf16's rounding (2^-9) and far below e4m3's (2^-4). x is clamped to >= -127 first, so
-inf (masked scores) gives 2^-127 ~ 5.9e-39 instead of NaN, which is 0 for every later use (a sum of such terms and
P~'s cast to e4m3 or bf16 alike).

`ptx(pack, n_poly)` is the body of an `inline_asm_elementwise` over `pack` fp32 values ("r" registers) of which
the first n_poly take the polynomial and the rest `ex2.approx.ftz.f32` (the MUFU instruction `gl.exp2` lowers
to); which elements of a thread's registers form a pack does not matter, the function being elementwise.
`reference` is the same arithmetic in torch (float32), for tests of the polynomial away from a GPU.
"""
from __future__ import annotations

import struct

import torch

# p(f) = 1 + C1 f + C2 f^2 + C3 f^3 (Lawson's iteration for the minimax relative error, float32-rounded)
C1, C2, C3 = 0.6951165199279785, 0.2276461124420166, 0.07706601917743683
MAX_REL_ERR = 8.6e-5
ROUND_MAGIC = 12582912.0   # 1.5 * 2^23: x + this (rounded toward -inf) holds floor(x) in its low mantissa bits
X_MIN = -127.0


def _f32(v: float) -> str:
    """A PTX float32 immediate (0fXXXXXXXX)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


def _poly_one(out: str, x: str) -> str:
    return (
        "{ .reg .b32 x, t, j, f, p;\n"
        f"max.ftz.f32 x, {x}, {_f32(X_MIN)};\n"
        f"add.rm.ftz.f32 t, x, {_f32(ROUND_MAGIC)};\n"     # t = 1.5 * 2^23 + floor(x), exactly
        f"sub.rn.ftz.f32 j, t, {_f32(ROUND_MAGIC)};\n"     # floor(x)
        "sub.rn.ftz.f32 f, x, j;\n"                         # f in [0, 1)
        f"fma.rn.ftz.f32 p, f, {_f32(C3)}, {_f32(C2)};\n"
        f"fma.rn.ftz.f32 p, p, f, {_f32(C1)};\n"
        f"fma.rn.ftz.f32 p, p, f, {_f32(1.0)};\n"            # p(f) in [1, 2)
        "shl.b32 t, t, 23;\n"                               # (bits(t) << 23) == floor(x) << 23 (mod 2^32)
        f"add.s32 {out}, p, t; }}\n")                       # 2^floor(x) * p(f)


def ptx(pack: int, n_poly: int) -> tuple[str, str]:
    """(asm, constraints) of an inline_asm_elementwise computing exp2 of `pack` float32 values, the first
    `n_poly` by the polynomial, the rest by ex2.approx.ftz.f32 (MUFU)."""
    if not 0 <= n_poly <= pack:
        raise ValueError(f"exp2.ptx: n_poly must be in [0, pack={pack}], got {n_poly}")
    lines = []
    for i in range(pack):
        out, x = f"${i}", f"${pack + i}"
        lines.append(_poly_one(out, x) if i < n_poly else f"ex2.approx.ftz.f32 {out}, {x};\n")
    return "".join(lines), ",".join(["=r"] * pack + ["r"] * pack)


def reference(x: torch.Tensor) -> torch.Tensor:
    """The polynomial path's arithmetic in float32 torch ops (floor instead of the rounding trick: the same j)."""
    x = torch.clamp(x.float(), min=X_MIN)
    j = torch.floor(x)
    f = x - j
    p = ((C3 * f + C2) * f + C1) * f + 1.0
    return torch.ldexp(p, j.to(torch.int32))
