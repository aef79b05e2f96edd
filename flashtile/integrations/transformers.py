"""flashtile as a Hugging Face transformers attention implementation: ``attn_implementation="flashtile"``.

    import flashtile.integrations.transformers as ft_hf
    ft_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flashtile")   # or from_pretrained(...)

Works with every model whose attention layers dispatch through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral,
Qwen2/3, Gemma 2/3, Phi-3, ...). The attention function receives q (batch, nheads, seqlen_q, headdim) and
k/v (batch, nheads_k, seqlen_k, headdim) from the model and calls flashtile with the flash-attn layout
(batch, seqlen, nheads, headdim):

* GQA/MQA: k/v keep their nheads_k heads (no ``repeat_kv``); the kernels map query head h to h // group.
* Padding: the model's mask arrives as the 2-D (batch, seqlen_k) padding mask (``register`` installs the mask
  builder ``padding_mask`` for this name: transformers' flash-attention mask, None when nothing is padded).
  Eager calls with more than one query per row (training, prefill) unpad the batch, run the varlen kernel and
  pad back (zeros at padding positions), as transformers' flash-attention path does. Under torch.compile (the
  mask not read while tracing) the custom ops ``flashtile::row_fwd`` / ``row_bwd`` read it when the graph runs
  and run the varlen kernel over each row's run of tokens (and over the padding as sequences of its own, whose
  rows are then zeroed); a mask whose tokens are not one run per row, or a CUDA graph being captured, gets the
  dense kernel with the mask as a key mask (``attn_mask``), as decode steps (one query per row) do: no value read,
  no shape depending on data, so a compiled model has no graph break here. The rows of padding queries are zeros
  on every path.
* Static cache (``cache_implementation="static"``): the eager prefill gets the 2-D mask of the prompt's slots
  (unpadded as above where it pads; where it pads nothing, the dense kernel over those slots); every decoding step
  gets transformers' 4-D boolean mask over the cache's slots (its ``sdpa_mask``: causal, window, padding and the
  slots without a token yet), whose shape is the same at every step, so transformers' compiled decoding step
  records one CUDA graph; the attention function runs it as ``attn_mask`` with no causal flag or window on top.
  Any 4-D boolean mask (batch or 1, 1 or heads, seqlen_q, seqlen_k) is taken that way.
* Packed batches without padding (``DataCollatorWithFlattening``): batch 1 whose position_ids restart, or the
  ``cu_seq_lens_q/k`` + ``max_length_q/k`` kwargs, run as varlen so that sequences do not see each other.
  Under torch.compile the positions are not read while tracing: the same ops read them when the graph runs and
  take the varlen or the dense kernels accordingly.
* Sliding window w (the ``sliding_window`` argument the model passes): window_size = (w - 1, 0) when causal,
  (w - 1, w - 1) otherwise, i.e. query i sees keys i - w + 1 .. i, transformers' ``kv_idx > q_idx - w``.
* softcap (Gemma 2), scaling, dropout (the model passes its attention_dropout only in training),
  deterministic (kwarg or FLASH_ATTENTION_DETERMINISTIC=1, like transformers' flash path).
* float32 runs in float32 (no cast to half precision: flashtile's kernels take fp32), CPU runs through the
  Triton interpreter.

Not supported (raise ValueError): attention sinks (``s_aux``), additive position biases (``position_bias``),
additive (float) 4-D masks. ``output_attentions`` returns None weights, as with transformers' flash-attention path.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..api import problem as P
from ..api.checks import check_device
from ..api.problem import values_readable
from ..interface import NO_EXTRAS, Extras, backward, flash_attn_func, forward
from ..kernels.dispatch import kernel_inputs
from ..kernels.runtime import environ
from ..kernels.triton.decode import prepare as prepare_decode
from ..padding import index_first_axis, packed_rows, pad_input, unpad_input
from ..varlen import flash_attn_varlen_func

NAME = "flashtile"
# Names registered by register(); the flash-name shim (below) recognises exactly these.
_REGISTERED: set = set()
_UNSET = object()


def _fail(arg: str, value, expected: str):
    raise ValueError(f"flashtile (transformers integration): {arg} = {value!r}; expected {expected}")


def _window(sliding_window, causal: bool):
    """transformers' sliding window w (the query and the w - 1 keys before it) -> flash-attn window_size."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        _fail("sliding_window", sliding_window, "None or an int >= 1")
    left = sliding_window - 1
    return (left, 0) if causal else (left, left)


def _packed_cu_seqlens(position_ids: torch.Tensor):
    """cu_seqlens (int32) and max length of a packed row (1, total): a sequence starts wherever the position
    does not continue the previous one (position_ids[t] != position_ids[t - 1] + 1)."""
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    start_idx = torch.nonzero(starts).flatten().to(torch.int32)
    total = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    cu = torch.cat([start_idx, total])
    return cu, int((cu[1:] - cu[:-1]).max().item())


# what was computed from a tensor (P.remembered; keys: what, the tensor): _is_packed / _packed_cu_seqlens of
# position_ids, packed_rows / _mask_runs of a padding mask. A model's layers see one such tensor per forward, whose
# values are then read once, not once per layer
_SEEN: dict = {}


def _per_tensor(name: str, t: torch.Tensor, compute):
    """compute(t), remembered for t until it is freed or modified in place (not while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return compute(t)
    return P.remembered(_SEEN, (t, ), (name, ), lambda: compute(t), limit=64)


def _packable(position_ids, batch: int, q_len: int, kv_len: int) -> bool:
    """Whether the shapes allow a packed row: batch 1, no cache (q_len == kv_len), at least 2 tokens, one position
    per token. Reads no value."""
    return (position_ids is not None and batch == 1 and q_len == kv_len and q_len >= 2
            and position_ids.numel() == q_len)


def _is_packed(position_ids, batch: int, q_len: int, kv_len: int) -> bool:
    """A packable row (_packable) whose positions are not one increasing run (reads them)."""
    if not _packable(position_ids, batch, q_len, kv_len):
        return False
    return _per_tensor("packed", position_ids, lambda t: bool((t.reshape(-1)[1:] != t.reshape(-1)[:-1] + 1).any()))


def _varlen_rows(q, k, v, cu_q, cu_k, max_q: int, max_k: int, opts: dict) -> torch.Tensor:
    """q (b, sq, h, d), k / v (b, sk, hk, d) whose rows, flattened, are the packed sequences cu_q / cu_k."""
    out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                 v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **opts)
    return out.view(*q.shape[:2], *out.shape[1:])


def _unpadded(q, k, v, mask, opts: dict) -> torch.Tensor:
    """Attention of a padded batch through the varlen kernel: the tokens of mask (b, m) unpadded, the output padded
    back (zeros at padding positions). The queries are the last sq positions of the mask (a cache holds the earlier
    ones; transformers assumes the same: left padding during generation). Reads the mask (host synchronisation)
    and makes tensors whose shapes depend on it: once per mask tensor (the layers of a forward share it), its
    packed layout then remembered until it is freed or modified. Where the queries are every position of the mask
    (training, prefill without a cache) they are unpadded with the keys' indices and share their cu_seqlens (one
    tensor: the kernels then keep one length per sequence). A mask without padding (every row's m tokens: a static
    cache's prompt of equal rows) runs the dense kernel over the keys it covers instead, gathering nothing."""
    batch, q_len = q.shape[:2]
    if k.shape[1] > mask.shape[1]:  # static cache: keys past the mask are unused slots
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
        prepare_decode(q.device)      # (the buffers its decode steps' kernel finds made under CUDA graphs)
    idx_k, cu_k, max_k = _per_tensor("unpad", mask, packed_rows)
    if idx_k.numel() == mask.numel():   # nothing padded
        return flash_attn_func(q, k, v, **opts)
    k_un, v_un = (index_first_axis(t.reshape(-1, *t.shape[2:]), idx_k) for t in (k, v))
    if q_len == mask.shape[1]:
        q_un, idx_q, cu_q, max_q = index_first_axis(q.reshape(-1, *q.shape[2:]), idx_k), idx_k, cu_k, max_k
    else:
        q_un, idx_q, cu_q, max_q, _ = unpad_input(q, mask[:, -q_len:])
    out = flash_attn_varlen_func(q_un, k_un, v_un, cu_q, cu_k, max_q, max_k, **opts)
    return pad_input(out, idx_q, batch, q_len)


def _key_masked(q, k, v, mask, opts: dict) -> torch.Tensor:
    """Attention of a padded batch through the dense kernel with the padding as a key mask (decode steps, static
    caches, traced calls over a cache): static shapes, no value read. mask (b, m), m <= sk: the queries are the
    mask's last sq positions; keys past the mask (a static cache's slots without a token yet) are masked. The
    kernels align causal and window masks to the last key (sk); where the mask ends earlier (m < sk) the queries'
    own alignment is folded into the mask instead. Rows of padding queries are zeros, as _unpadded leaves them."""
    q_len, kv_len, m = q.shape[1], k.shape[1], mask.shape[1]
    q_real = mask[:, m - q_len:]
    if kv_len == m:
        out = flash_attn_func(q, k, v, attn_mask=mask[:, None, None, :], **opts)
    else:
        left, right = opts["window_size"]
        if opts["causal"]:
            right = 0
        q_pos = torch.arange(m - q_len, m, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        visible = torch.nn.functional.pad(mask, (0, kv_len - m))[:, None, None, :]
        if left >= 0:
            visible = visible & (k_pos >= q_pos - left)
        if right >= 0:
            visible = visible & (k_pos <= q_pos + right)
        out = flash_attn_func(q, k, v, attn_mask=visible, **dict(opts, causal=False, window_size=(-1, -1)))
    return out.masked_fill(~q_real[:, :, None, None], 0.0)


def _full_mask(q, k, v, mask, opts: dict) -> torch.Tensor:
    """Attention under a 4-D boolean mask (batch or 1, 1 or nheads, seqlen_q, seqlen_k), True = attend: the whole
    visibility pattern (causal, window and padding included, as transformers' sdpa_mask builds it for a static
    cache), so the model's causal flag and window are not applied on top. A row that sees no key is zeros. An eager
    call makes the decode kernel's persistent buffers (as _unpadded does in a static cache's prefill), which the
    decode steps of transformers' compiled step (CUDA graphs) then find made."""
    if values_readable(q):
        prepare_decode(q.device)
    return flash_attn_func(q, k, v, attn_mask=mask, **dict(opts, causal=False, window_size=(-1, -1)))


# ----------------------------------------------------------------------------------------------------------------
# Rows under torch.compile whose sequences are known only when the graph runs: a batch-1 row that may pack several
# sequences (its position_ids), or a padded batch (its padding mask)
# ----------------------------------------------------------------------------------------------------------------
PACKED, PADDED = 0, 1   # what the rows ops' `seqs` tensor is: position_ids (1, s), or a padding mask (b, s)


def _mask_runs(mask: torch.Tensor):
    """cu_seqlens (int32, on the mask's device) of a padded batch (b, s) flattened to b * s tokens, three sequences
    per row: the padding before the row's tokens, its tokens, the padding after them (empty where there is none);
    None where a row's tokens are not one contiguous run (then only a key mask is right). Reads the mask."""
    m = mask.to("cpu").bool()
    b, s = m.shape
    used = m.sum(1)
    start = m.int().argmax(1) * (used > 0)          # first token of each row (0 for a row without one)
    pos = torch.arange(s)
    if not torch.equal((pos >= start[:, None]) & (pos < (start + used)[:, None]), m):
        return None
    base = torch.arange(b) * s
    cu = torch.cat([torch.stack([base, base + start, base + start + used], 1).reshape(-1), torch.tensor([b * s])])
    return cu.to(device=mask.device, dtype=torch.int32)


def _row_problem(q, k, v, seqs, kind, ints, floats):
    """(Problem, q, k, v, Extras) of the rows as they run. PACKED (batch 1, seqs = position_ids): the dense Problem
    traced for them (ints, floats: Problem.pack), or, where the positions restart (read here, once per tensor),
    the varlen Problem of the row's sequences. PADDED (seqs = the (b, s) padding mask, s queries and keys): the
    varlen Problem of _mask_runs' sequences over the b * s tokens (read once per mask tensor; the padding's own
    sequences compute rows the caller zeroes), or, where a row's tokens are not one run or a CUDA graph is being
    captured (no value may be read), the dense Problem with the mask as a key mask. A packed row inside a capture
    raises (its sequences cannot be known). Varlen: q / k / v flattened to (b * s, heads, d)."""
    p = P.Problem.unpack(q, k, ints, floats, q.shape[0])
    s = q.shape[1]
    readable = values_readable(seqs)   # (False inside a CUDA-graph capture)
    if kind == PACKED:
        if not readable:
            _fail("position_ids", "a batch-1 row's positions inside a CUDA-graph capture",
                  "positions the host can read: whether the row packs several sequences is read from them, which a "
                  "capture does not allow; compile without CUDA graphs (a mode other than 'reduce-overhead'), or "
                  "pass cu_seq_lens_q / cu_seq_lens_k and max_length_q / max_length_k "
                  "(DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
        if not _is_packed(seqs, 1, s, k.shape[1]):
            return p, q, k, v, NO_EXTRAS
        cu, max_len = _per_tensor("cu_seqlens", seqs, _packed_cu_seqlens)
    else:
        cu, max_len = _per_tensor("runs", seqs, _mask_runs) if readable else None, s
        if cu is None:
            mask = seqs.bool()[:, None, None, :]
            return p.with_features(mask=True), q, k, v, Extras(mask=mask)
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    w = p.params   # (the window already holds causal: window_right = 0)
    p = P.varlen(q, k, v, cu, cu, max_len, max_len, w.dropout_p, w.softmax_scale, False,
                 (w.window_left, w.window_right), w.softcap, None, p.deterministic, False)
    return p, q, k, v, Extras(cu_seqlens_q=cu, cu_seqlens_k=cu)


@torch.library.custom_op("flashtile::row_fwd", mutates_args=(), device_types=None)
def _row_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor, kind: int, ints: List[int],
             floats: List[float]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (b, s, h, d), lse (b, h, s), the dropout's rng state (2,) of rows whose sequences seqs says
    (_row_problem)."""
    p, qr, kr, vr, x = _row_problem(q, k, v, seqs, kind, ints, floats)
    qr, kr, vr = kernel_inputs(p, qr, kr, vr)
    out, lse, rng_state, _ = forward(p, qr, kr, vr, x)
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64)
    if p.varlen:   # (h, b * s) -> (b, h, s)
        lse = lse.view(lse.shape[0], q.shape[0], q.shape[1]).transpose(0, 1).contiguous()
    return out.view(q.shape), lse, rng_state


@_row_fwd.register_fake
def _(q, k, v, seqs, kind, ints, floats):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32), torch.empty(2, dtype=torch.int64))


@torch.library.custom_op("flashtile::row_bwd", mutates_args=(), device_types=None)
def _row_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, rng_state: torch.Tensor, seqs: torch.Tensor, kind: int, ints: List[int],
             floats: List[float]) -> List[torch.Tensor]:
    """dq, dk, dv of _row_fwd. _row_problem decides as it did for the forward, except where only one of the two
    ran inside a CUDA-graph capture: then one took the key mask, the other varlen, and the padding's rows carry
    the other route's lse, with which their recomputed P may overflow (inf * 0 = NaN). Their gradient is zero (the
    caller zeroed their outputs), so they get lse = +inf: P = 0 under either route. A dropout mask, though, is
    drawn for its route's layout: a backward inside a capture (whose forward, with dropout, ran outside one, as a
    forward inside one raises) raises too."""
    if kind == PADDED:
        lse = lse.masked_fill(~seqs.bool()[:, None, :], float("inf"))
    p, qr, kr, vr, x = _row_problem(q, k, v, seqs, kind, ints, floats)
    if p.params.dropout_p > 0 and not values_readable(seqs):
        _fail("dropout_p", p.params.dropout_p, "0 for a padded batch whose backward runs inside a CUDA-graph capture "
              "(its forward, outside one, drew the dropout mask for the varlen route)")
    qr, kr, vr = kernel_inputs(p, qr, kr, vr)
    if p.varlen:
        dout, out, lse = dout.reshape(qr.shape), out.reshape(qr.shape), lse.transpose(0, 1).reshape(lse.shape[1], -1)
    grads = backward(p, dout, qr, kr, vr, out, lse, rng_state if p.params.dropout_p > 0 else None, x)
    return [g.view(t.shape) for g, t in zip(grads, (q, k, v))]


@_row_bwd.register_fake
def _(dout, q, k, v, out, lse, rng_state, seqs, kind, ints, floats):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]


def _row_setup(ctx, inputs, output):
    q, k, v, seqs, kind, ints, floats = inputs
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, seqs)
    ctx.kind, ctx.ints, ctx.floats = kind, ints, floats


def _row_backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, rng_state, seqs = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashtile.row_bwd(dout, q, k, v, out, lse, rng_state, seqs, ctx.kind, ctx.ints,
                                            ctx.floats)
    return dq, dk, dv, None, None, None, None


_row_fwd.register_autograd(_row_backward, setup_context=_row_setup)


def _traced_rows(q, k, v, seqs, kind: int, opts: dict) -> torch.Tensor:
    """Attention of rows whose sequences are decided when the graph runs (_row_problem), without reading seqs while
    tracing: the ops flashtile::row_fwd / row_bwd read it then. The dense problem is checked here, as
    flash_attn_func checks it."""
    window_size, causal, deterministic = P.scalars(opts["window_size"], ("causal", opts["causal"]),
                                                   ("deterministic", opts["deterministic"]))
    q, k, v = P.contiguous_last(q, k, v)
    p = P.dense(q, k, v, opts["dropout_p"], opts["softmax_scale"], causal, window_size, opts["softcap"], None,
                deterministic, False)
    check_device(q)
    ints, floats = p.pack()
    return torch.ops.flashtile.row_fwd(q, k, v, seqs, kind, ints, floats)[0]


def flashtile_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window=_UNSET,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """The ``AttentionInterface`` function: query (b, h, sq, d), key/value (b, hk, sk, d) -> (out (b, sq, h, d), None).

    attention_mask: None (no padding) or the 2-D (b, sk) padding mask, True/1 = token (transformers' flash
    mask). sliding_window: the window the model passes (None = full attention); a model that does not pass
    the argument at all falls back to ``module.sliding_window``. Models with per-layer windows (Qwen2, Gemma)
    pass None for their full-attention layers, so the config's window is deliberately not consulted.
    """
    if kwargs.get("s_aux") is not None:
        _fail("s_aux", "a tensor", "None (attention sinks are not supported by flashtile)")
    if kwargs.get("position_bias") is not None:
        _fail("position_bias", "a tensor", "None (additive position biases are not supported by flashtile)")
    if sliding_window is _UNSET:
        sliding_window = getattr(module, "sliding_window", None)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window_size = _window(sliding_window, causal)
    softcap = 0.0 if softcap is None else float(softcap)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = environ("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    opts = dict(dropout_p=float(dropout or 0.0), softmax_scale=scaling, causal=causal, window_size=window_size,
                softcap=softcap, deterministic=bool(deterministic))

    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    # (b, h, s, d) -> (b, s, h, d): a transposed view; the kernels take any strides with a contiguous last dim
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if v_head_dim != head_dim:  # e.g. MLA: the kernels need one head dim; zero columns of V give zero outputs
        if v_head_dim > head_dim:
            _fail("value head dim", v_head_dim, f"<= the query head dim {head_dim}")
        v = torch.nn.functional.pad(v, (0, head_dim - v_head_dim))

    # eager calls may read the mask and the positions; traced ones (torch.compile) take paths with static shapes
    # (values_readable: asked only where a path reads values, a decoding step's plain call never does)
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype == torch.bool:
        out = _full_mask(q, k, v, attention_mask, opts)
    elif attention_mask is not None:
        if attention_mask.dim() != 2:
            _fail("attention_mask", f"a {attention_mask.dim()}-D {attention_mask.dtype} tensor",
                  "the (batch, seqlen_k) padding mask that transformers builds for attn_implementation="
                  f"{NAME!r}, or a 4-D boolean mask (batch, 1, seqlen_q, seqlen_k) (additive float masks are not "
                  "supported)")
        if attention_mask.shape[1] < q_len:
            _fail("attention_mask.shape[1]", attention_mask.shape[1], f">= seqlen_q = {q_len} (the queries are the "
                  "mask's last positions)")
        mask = attention_mask.bool()
        if k.shape[1] < mask.shape[1]:
            mask = mask[:, -k.shape[1]:]
        if q_len > 1 and values_readable(q):
            out = _unpadded(q, k, v, mask, opts)
        elif q_len == kv_len == attention_mask.shape[1] and q_len > 1:   # traced training / prefill
            out = _traced_rows(q, k, v, attention_mask, PADDED, opts).masked_fill(~mask[:, :, None, None], 0.0)
        else:
            out = _key_masked(q, k, v, mask, opts)
    elif (kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None
          and kwargs.get("max_length_q") is not None and kwargs.get("max_length_k") is not None):
        cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)   # (one tensor for both stays one: kernels keep one length)
        cu_k = cu_q if kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"] else kwargs["cu_seq_lens_k"].to(torch.int32)
        out = _varlen_rows(q, k, v, cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), opts)
    elif not _packable(position_ids, batch, q_len, kv_len):
        out = flash_attn_func(q, k, v, **opts)
    elif not values_readable(q):
        out = _traced_rows(q, k, v, position_ids, PACKED, opts)
    elif _is_packed(position_ids, batch, q_len, kv_len):
        cu, max_len = _per_tensor("cu_seqlens", position_ids, _packed_cu_seqlens)
        out = _varlen_rows(q, k, v, cu, cu, max_len, max_len, opts)
    else:
        out = flash_attn_func(q, k, v, **opts)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def padding_mask(*, kv_length: int, attention_mask=None, **kwargs):
    """The mask builder registered with the attention function: transformers' flash-attention mask (the 2-D
    (batch, kv_length) padding mask, None when nothing is padded). Deciding "nothing is padded" reads the mask; while
    values cannot be read (torch.compile tracing) the mask is passed on as it is instead, and the attention function
    treats an all-ones mask like any other.

    A static cache's decoding steps (kv_length cache slots, more than the 2-D mask's tokens) get transformers' 4-D
    boolean mask instead (sdpa_mask: (batch, 1, 1, kv_length), True = attend), as SDPA does: its shape is the
    cache's at every step, so a compiled decoding step (CUDA graphs) sees one input shape, where a 2-D mask growing
    by one column per step made it record a graph per step. So does the last step, whose 2-D mask covers every
    slot: transformers marks a decoding step over a compileable cache with allow_is_causal_skip=False (else that
    step's None or 2-D mask would be a new input, compiled and recorded anew in every generate call). The eager
    prefill of several queries keeps the 2-D mask: the attention function unpads its tokens, or runs the dense
    kernel over them where nothing is padded (the slots past them unused either way), where a 4-D mask would have
    the kernel compute every (query, slot) pair."""
    q_len = kwargs.get("q_length")
    if q_len is None and kwargs.get("cache_position") is not None:   # (transformers before q_length)
        q_len = kwargs["cache_position"].shape[0]
    static_step = kwargs.get("allow_is_causal_skip") is False and q_len == 1
    if attention_mask is not None and (attention_mask.shape[1] < kv_length or static_step):
        if q_len is not None and q_len > 1 and values_readable(attention_mask):
            return attention_mask
        from transformers.masking_utils import sdpa_mask
        return sdpa_mask(kv_length=kv_length, attention_mask=attention_mask.bool(),
                         **dict(kwargs, allow_is_causal_skip=False))
    if attention_mask is not None and not values_readable(attention_mask):
        return attention_mask[:, -kv_length:]
    from transformers.masking_utils import flash_attention_mask
    return flash_attention_mask(kv_length=kv_length, attention_mask=attention_mask, **kwargs)


def _accept_flash_named(name: str) -> None:
    """transformers treats every implementation whose name contains "flash" as a flash-attn build and, when a
    model is created, pre-imports it with ``lazy_import_flash_attention(name)``, which looks for a hub kernel
    of that name and fails for a registered function. Wrap that pre-import (in ``modeling_utils``, where
    model construction calls it) so that registered flashtile names skip it: there is nothing to import,
    the attention function is already in ``ALL_ATTENTION_FUNCTIONS``. Every other name goes through
    unchanged. Being seen as a flash implementation is otherwise what flashtile wants: transformers then
    passes 2-D padding masks and keeps masks out of generation's all-ones fast path the same way."""
    from transformers import modeling_utils
    from transformers.utils.generic import is_flash_attention_requested

    if not is_flash_attention_requested(requested_attention_implementation=name):
        return
    original = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_flashtile_wrapped", False):
        return

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in _REGISTERED:
            return None
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._flashtile_wrapped = True
    lazy_import_flash_attention.__wrapped__ = original
    modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def register(name: str = NAME) -> str:
    """Register flashtile with transformers under ``name`` (default "flashtile"); idempotent.

    Installs the attention function (``AttentionInterface``) and, for the same name, the mask builder
    ``padding_mask`` (``AttentionMaskInterface``: the 2-D padding mask); without a mask builder transformers
    would pass no mask at all. Returns the name to pass as attn_implementation.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError("flashtile.integrations.transformers needs transformers >= 5.17 "
                          "(pip install 'transformers>=5.17')") from e
    AttentionInterface.register(name, flashtile_attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    _REGISTERED.add(name)
    _accept_flash_named(name)
    return name
