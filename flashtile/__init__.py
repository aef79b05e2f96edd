"""flashtile: exact, IO-aware attention (FlashAttention 1/2/3 and the online softmax they rest on).

Public names follow flash-attn 2.x, so existing code switches with an import change:
    from flashtile import flash_attn_func
"""
import os as _os

import torch as _torch

# Triton decides at kernel-definition time whether to interpret; without a CUDA device the kernels run
# on CPU tensors through the interpreter (same source, slow, exact), so turn it on before they are defined.
if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from .blocksparse import BlockMask, blocksparse_attn_func, create_block_mask  # noqa: E402
from .fp8 import flash_attn_fp8_func, quantize_fp8  # noqa: E402
from .interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache  # noqa: E402
from .padding import index_first_axis, index_put_first_axis, pad_input, unpad_input  # noqa: E402
from .varlen import (  # noqa: E402
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__version__ = "0.1.0"
__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache", "unpad_input", "pad_input", "index_first_axis", "index_put_first_axis",
    "flash_attn_fp8_func", "quantize_fp8", "BlockMask", "blocksparse_attn_func", "create_block_mask",
]
