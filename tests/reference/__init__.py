"""Helpers for the reference-algorithm tests: random batched inputs, the float64 oracle with autograd
gradients, and a driver that runs a per-head reference algorithm over every (batch, head)."""
import torch

from flashtile.reference import rng
from flashtile.reference.dense import attention_ref
from flashtile.reference.io_model import run

TOL64 = dict(rtol=0.0, atol=1e-10)


def make_inputs(B, H, N_q, N_k, d, dtype=torch.float64, padding=False):
    """q, dO (B, N_q, H, d); k, v (B, N_k, H, d); key_padding_mask (B, N_k) bool or None. The padding mask
    keeps ~70% of keys and always keeps key 0, so no row is empty unless a test makes it so."""
    q, do = (torch.randn(B, N_q, H, d, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, N_k, H, d, dtype=dtype) for _ in range(2))
    kpm = None
    if padding:
        kpm = torch.rand(B, N_k) < 0.7
        kpm[:, 0] = True
    return q, k, v, do, kpm


def oracle(q, k, v, do, *, key_padding_mask=None, causal=False, dropout_p=0.0, seed=0, offset=0,
           softmax_scale=None, attn_mask=None):
    """dense.attention_ref in float64 and torch.autograd's gradients of it: (out, lse, dq, dk, dv)."""
    B, N_q, H, _ = q.shape
    N_k = k.shape[1]
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    keep = rng.dropout_keep_mask(seed, offset, B, H, N_q, N_k, dropout_p) if dropout_p > 0 else None
    out, lse, _ = attention_ref(q, k, v, causal=causal, key_padding_mask=key_padding_mask, dropout_p=dropout_p,
                                dropout_mask=keep, softmax_scale=softmax_scale, attn_mask=attn_mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.double())
    return out.detach(), lse.detach(), dq, dk, dv


def run_batched(algorithm, q, k, v, do, *, key_padding_mask=None, block_masks=None, **kw):
    """Run ``algorithm`` (io_model.run) head by head; returns (out, lse, dq, dk, dv) in the batched layout
    (lse None for standard attention). block_masks: one block mask per batch index, or None."""
    B, _, H, _ = q.shape
    outs, lses, grads = [], [], []
    for b in range(B):
        for h in range(H):
            r = run(algorithm, q[b, :, h], k[b, :, h], v[b, :, h], do[b, :, h],
                    key_padding_mask=None if key_padding_mask is None else key_padding_mask[b],
                    block_mask=None if block_masks is None else block_masks[b], b=b, h=h, nheads=H, **kw)
            outs.append(r.O)
            lses.append(r.lse)
            grads.append((r.dQ, r.dK, r.dV))

    def stack(xs, n):  # per-head (n, d) tensors in (b, h) order -> (B, n, H, d)
        return torch.stack(xs).view(B, H, n, -1).transpose(1, 2)

    out = stack(outs, q.shape[1])
    lse = None if lses[0] is None else torch.stack(lses).view(B, H, -1)
    dq, dk, dv = (stack([g[n] for g in grads], x.shape[1]) for n, x in enumerate((q, k, v)))
    return out, lse, dq, dk, dv
