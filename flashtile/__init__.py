"""flashtile: exact, IO-aware attention (FlashAttention 1/2/3 and the online softmax they rest on).

Public names follow flash-attn 2.x, so existing code switches with an import change.
"""
__version__ = "0.1.0"
