"""Glue between flashtile and other frameworks, kept apart from the kernels and the public API.

    from flashtile.integrations import register_transformers
    register_transformers()                      # attn_implementation="flashtile" in Hugging Face transformers

Nothing here is imported by ``import flashtile``; each integration imports its framework lazily.
"""
from .transformers import register as register_transformers

__all__ = ["register_transformers"]
