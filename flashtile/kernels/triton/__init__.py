"""Triton kernels (NVIDIA GPUs sm80+, and CPU tensors through TRITON_INTERPRET=1 with the same source)."""
