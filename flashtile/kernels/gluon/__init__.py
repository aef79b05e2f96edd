"""Kernels written in Gluon (Triton's lower-level DSL) for one architecture: today FlashAttention-3's Hopper
forward and backward (fa3.py) and a paged decode (paged.py). Each module here says when it applies and
kernels/dispatch.py asks it; everything else runs the portable Triton kernels."""
