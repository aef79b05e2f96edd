"""Kernels written in Gluon (Triton's lower-level DSL) for one architecture: today FlashAttention-3's Hopper
forward (fa3.py). Each module here says when it applies; everything else runs the portable Triton kernels."""
