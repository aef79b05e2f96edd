"""The attention implementations the benchmark runs side by side: one registry, one function per provider.

A provider is a *factory* ``make(device, dtype) -> attn`` registered under a name. The factory does the
imports and the cheap capability checks and raises :class:`ProviderUnavailable` (or ``ImportError``) with a
reason when the provider cannot run here; the runner records that reason and reports the provider as
skipped. The returned ``attn(q, k, v, causal) -> out`` takes and returns tensors in the provider's own
layout, so that no transpose or copy is timed:

- ``"bshd"``: (batch, seqlen, nheads, headdim), flash-attn's layout (flashtile, FA2, FA3, FA4);
- ``"bhsd"``: (batch, nheads, seqlen, headdim), PyTorch's layout (SDPA, FlexAttention, eager).

Anything that goes wrong later (an SDPA backend that refuses this head dim, a kernel that does not fit in
shared memory) surfaces at the first call, which the runner makes untimed and catches.

Adding a provider is one decorated function::

    @register_provider("flashtile-fp8", layout="bshd", description="flashtile FP8 forward", tolerance=5e-2)
    def _flashtile_fp8(device, dtype):
        from flashtile.fp8 import flash_attn_fp8_func  # ImportError -> skipped, with the reason
        return lambda q, k, v, causal: first_output(flash_attn_fp8_func(q, k, v, causal=causal))

(a forward-only provider is timed in fwd and reported 'skipped' in bwd, with the error its backward raised).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable, Dict, Optional, Tuple

import torch

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
Factory = Callable[[torch.device, torch.dtype], AttnFn]

LAYOUTS = ("bshd", "bhsd")


class ProviderUnavailable(RuntimeError):
    """Raised by a provider factory when the provider cannot run on this machine; the message is the reason."""


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    factory: Factory
    layout: str = "bshd"
    description: str = ""
    devices: Tuple[str, ...] = ("cuda",)  # device types it may run on; others are skipped without a call
    tolerance: Optional[float] = None  # relative-error bound; None = measure.TOLERANCE[dtype]
    # the modules the factory imports: available_providers says whether they import here even where the device
    # rules the provider out before its factory runs (a CPU machine with flash-attn installed)
    modules: Tuple[str, ...] = ()

    def make(self, device: torch.device, dtype: torch.dtype) -> AttnFn:
        """The provider's attention function for (device, dtype); raises ProviderUnavailable with a reason."""
        device = torch.device(device)
        if device.type not in self.devices:
            raise ProviderUnavailable(f"runs on {'/'.join(self.devices)} only, not on {device.type}")
        try:
            return self.factory(device, dtype)
        except ProviderUnavailable:
            raise
        except ImportError as e:  # the package is absent or broken
            raise ProviderUnavailable(f"import failed: {type(e).__name__}: {e}") from e


PROVIDERS: Dict[str, Provider] = {}
ALIASES = {"sdpa-cudnn": "cudnn", "flash-attn": "fa2", "flex-attention": "flex", "standard": "eager"}


def register_provider(name: str, *, layout: str = "bshd", description: str = "", devices=("cuda",),
                      tolerance: Optional[float] = None, modules=(), registry: Dict[str, Provider] | None = None):
    """Decorator: register ``factory(device, dtype) -> attn`` under ``name`` (in PROVIDERS by default); ``modules``:
    the modules the factory imports."""
    if layout not in LAYOUTS:
        raise ValueError(f"register_provider: layout={layout!r}, expected one of {LAYOUTS}")
    registry = PROVIDERS if registry is None else registry

    def deco(factory: Factory) -> Factory:
        if name in registry:
            raise ValueError(f"register_provider: a provider named {name!r} is already registered")
        registry[name] = Provider(name, factory, layout, description, tuple(devices), tolerance, tuple(modules))
        return factory

    return deco


def resolve_names(names, registry: Dict[str, Provider] | None = None) -> list[str]:
    """Canonical provider names for user-given names ("all" = every registered one, in registry order).

    Raises ValueError naming the unknown provider and listing the known ones.
    """
    registry = PROVIDERS if registry is None else registry
    out: list[str] = []
    for raw in names:
        name = ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if name == "all":
            out.extend(n for n in registry if n not in out)
            continue
        if name not in registry:
            raise ValueError(f"unknown provider {raw!r}; known: {', '.join(registry)} (or 'all')")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("no provider selected")
    return out


def _import_failure(modules) -> Optional[str]:
    """Why one of these modules does not import here, or None when they all do."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - a broken third-party install is as unusable as an absent one
            return f"import {module} failed: {type(e).__name__}: {e}"
    return None


def available_providers(device=None, dtype: Optional[torch.dtype] = None,
                        registry: Dict[str, Provider] | None = None) -> Dict[str, dict]:
    """Which providers can run here, without running any: name -> {"available": bool, "importable": bool,
    "reason": str | None, "layout": str, "description": str}.

    available: the factory makes an attention function for ``device`` (default cuda when present, else cpu) and
    ``dtype`` (default bf16 on cuda, fp16 on cpu, as ``flashtile bench``); importable: the provider's modules import
    here, whatever the device; reason: why it is not available (None when it is).
    """
    registry = PROVIDERS if registry is None else registry
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    out = {}
    for name, prov in registry.items():
        import_error = _import_failure(prov.modules)
        try:
            prov.make(device, dtype)
            reason = None
        except Exception as e:  # ProviderUnavailable, or any surprise in a third-party factory
            reason = str(e) if isinstance(e, ProviderUnavailable) else f"{type(e).__name__}: {e}"
        if import_error is not None and (reason is None or "import" not in reason):
            reason = import_error if reason is None else f"{reason}; {import_error}"
        out[name] = {"available": reason is None, "importable": import_error is None, "reason": reason,
                     "layout": prov.layout, "description": prov.description}
    return out


def first_output(out):
    """FA3 and FA4 return (out, lse) in some versions; the benchmark needs only out."""
    return out[0] if isinstance(out, (tuple, list)) else out


# --------------------------------------------------------------------------------------------------------
# flashtile
# --------------------------------------------------------------------------------------------------------
@register_provider("flashtile", layout="bshd", devices=("cuda", "cpu"), modules=("flashtile", ),
                   description="flashtile.flash_attn_func (Triton; on Hopper the FA3 Gluon forward where it applies; "
                               "on CPU through the Triton interpreter)")
def _flashtile(device, dtype):
    import flashtile

    fn = getattr(flashtile, "flash_attn_func", None)
    if fn is None:
        raise ProviderUnavailable("flashtile.flash_attn_func is not defined in this checkout")
    return lambda q, k, v, causal: fn(q, k, v, causal=causal)


@register_provider("flashtile-triton", layout="bshd", devices=("cuda", "cpu"),
                   modules=("flashtile.kernels.gluon.fa3", ),
                   description="flashtile.flash_attn_func with the Gluon FA3 kernels (forward and backward) "
                               "turned off: Triton kernels only")
def _flashtile_triton(device, dtype):
    import flashtile
    from flashtile.kernels.gluon import fa3

    def attn(q, k, v, causal):
        with fa3.disabled():
            return flashtile.flash_attn_func(q, k, v, causal=causal)
    return attn


@register_provider("flashtile-bhsd", layout="bhsd", devices=("cuda", "cpu"), modules=("flashtile", ),
                   description="flashtile.flash_attn_func given (batch, nheads, seqlen, headdim) memory seen "
                               "transposed, as SDPA-style models hold it (copied for the Hopper kernels from "
                               "kernels.dispatch.COPY_MIN_WORK, else read strided by the Triton kernels)")
def _flashtile_bhsd(device, dtype):
    import flashtile

    def attn(q, k, v, causal):
        out = flashtile.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return out.transpose(1, 2)
    return attn


# --------------------------------------------------------------------------------------------------------
# PyTorch SDPA backends, each forced with sdpa_kernel([backend]): a backend that cannot serve the inputs
# raises "No available kernel" at the first call (with the reasons as warnings, which the runner keeps).
# --------------------------------------------------------------------------------------------------------
def _sdpa(backend_name: str) -> Factory:
    def factory(device, dtype):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            raise ProviderUnavailable(f"torch {torch.__version__} has no SDPBackend.{backend_name}")

        def attn(q, k, v, causal):   # ((batch, heads, seqlen, d); k, v may have fewer heads: GQA)
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

        return attn

    return factory


_SDPA_MODULES = ("torch.nn.attention", )
register_provider("sdpa-flash", layout="bhsd", description="torch SDPA, FLASH_ATTENTION backend (FA2)",
                  modules=_SDPA_MODULES)(_sdpa("FLASH_ATTENTION"))
register_provider("cudnn", layout="bhsd", description="torch SDPA, CUDNN_ATTENTION backend",
                  modules=_SDPA_MODULES)(_sdpa("CUDNN_ATTENTION"))
register_provider("sdpa-efficient", layout="bhsd", description="torch SDPA, EFFICIENT_ATTENTION backend",
                  modules=_SDPA_MODULES)(_sdpa("EFFICIENT_ATTENTION"))
register_provider("sdpa-math", layout="bhsd", devices=("cuda", "cpu"), modules=_SDPA_MODULES,
                  description="torch SDPA, MATH backend (unfused reference)")(_sdpa("MATH"))


# --------------------------------------------------------------------------------------------------------
# Standard attention: S = QK^T in the input dtype, softmax in float32, O = PV. Materialises (N, N) twice.
# --------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device) -> torch.Tensor:
    """True where the key is masked out (bottom-right aligned, as flash-attn)."""
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    return j > i + (seqlen_k - seqlen_q)


@register_provider("eager", layout="bhsd", devices=("cuda", "cpu"),
                   description="standard attention: matmul, softmax in float32, matmul")
def _eager(device, dtype):
    def attn(q, k, v, causal):
        scale = q.shape[-1] ** -0.5
        s = torch.matmul(q, k.transpose(-2, -1)).float() * scale
        if causal:
            s = s.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
        p = torch.softmax(s, dim=-1).to(v.dtype)
        return torch.matmul(p, v)

    return attn


# --------------------------------------------------------------------------------------------------------
# FlexAttention: torch.compile(flex_attention) once per process; block masks cached per shape.
# --------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    # Every (shape, causal) of the grid is a recompile; the default limit (8) would silently fall back to
    # the unfused eager flex_attention after the 8th, which measures something else entirely.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), 256))
            break
    return torch.compile(flex_attention, dynamic=False)


@register_provider("flex", layout="bhsd", description="torch.compile(flex_attention), create_block_mask for causal",
                   modules=("torch.nn.attention.flex_attention", ))
def _flex(device, dtype):
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = _compiled_flex()
    block_masks: dict = {}

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def attn(q, k, v, causal):
        if not causal:
            return compiled(q, k, v)
        key = (q.shape[-2], k.shape[-2], str(q.device))
        if key not in block_masks:
            if q.shape[-2] != k.shape[-2]:
                raise ValueError("flex provider: causal mask implemented for seqlen_q == seqlen_k only")
            block_masks[key] = create_block_mask(causal_mod, None, None, q.shape[-2], k.shape[-2],
                                                 device=q.device)
        return compiled(q, k, v, block_mask=block_masks[key])

    return attn


# --------------------------------------------------------------------------------------------------------
# flash-attn packages, when installed: FA2 (flash_attn), FA3 (flash_attn_interface, Hopper), FA4 (CuTe DSL).
# --------------------------------------------------------------------------------------------------------
@register_provider("fa2", layout="bshd", description="flash_attn.flash_attn_func (FlashAttention-2)",
                   modules=("flash_attn", ))
def _fa2(device, dtype):
    from flash_attn import flash_attn_func

    return lambda q, k, v, causal: first_output(flash_attn_func(q, k, v, causal=causal))


@register_provider("fa3", layout="bshd", description="flash_attn_interface.flash_attn_func (FlashAttention-3)",
                   modules=("flash_attn_interface", ))
def _fa3(device, dtype):
    from flash_attn_interface import flash_attn_func

    return lambda q, k, v, causal: first_output(flash_attn_func(q, k, v, causal=causal))


@register_provider("fa4", layout="bshd", description="flash_attn.cute.flash_attn_func (FlashAttention-4, CuTe DSL)",
                   modules=("flash_attn.cute", ))
def _fa4(device, dtype):
    from flash_attn.cute import flash_attn_func

    return lambda q, k, v, causal: first_output(flash_attn_func(q, k, v, causal=causal))
