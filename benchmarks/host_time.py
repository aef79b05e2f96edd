"""Host time per call: how long the CPU spends issuing flashtile's kernels, on problems too small to be GPU-bound.

    PYTHONPATH=. python benchmarks/host_time.py [--profile N] [--only NAME,NAME]     (GPU machine)

Times 200 calls without synchronising (best of 5) of:
- dense (b1 n128 h4 d128 bf16, causal): launch.flash_bwd and launch.flash_fwd called directly (the kernel launches
  and their host logic), flash_attn_func without autograd, its forward on inputs that require grad (what the
  benchmark's forward times), and a training step (forward, then backward); SDPA (cuDNN backend) beside them;
- decode (flash_attn_with_kvcache, b1, seqlen_q 1, nheads 32 / 8, d128 bf16, 4k cache, value checks off as a
  serving loop would have them): int cache_seqlens, tensor cache_seqlens, paged (page 256), with an appended
  token; SDPA (cuDNN) on the same cache.
--profile N: after the timings, cProfile each measured call (N calls) and print its N heaviest functions by own time.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.api import problem as _problem
from flashtile.kernels.triton import launch as L


def dense_calls():
    torch.manual_seed(0)
    d = 128
    q, k, v = (torch.randn(1, 128, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    o, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out = o.detach()
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    p = L.AttnParams(softmax_scale=d ** -0.5, window_right=0)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))

    def bwd():
        L.flash_bwd(do, qd, kd, vd, out, lse, dq, dk, dv, p)

    def fwd():
        L.flash_fwd(qd, kd, vd, dq, lse, p)

    def api_nograd():
        with torch.no_grad():
            flashtile.flash_attn_func(q, k, v, causal=True)

    def api_fwd_grad():
        flashtile.flash_attn_func(q, k, v, causal=True)

    def api_train():
        o = flashtile.flash_attn_func(q, k, v, causal=True)
        o.backward(do)

    def sdpa_cudnn_nograd():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    return [bwd, fwd, api_nograd, api_fwd_grad, api_train, sdpa_cudnn_nograd]


def decode_calls():
    torch.manual_seed(0)
    b, h, hk, d, cache, page = 1, 32, 8, 128, 4096, 256
    kc, vc = (torch.randn(b, cache, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k1, v1 = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((b,), cache - 1, dtype=torch.int32, device="cuda")
    kp, vp = (x.view(b * cache // page, page, hk, d) for x in (kc, vc))
    table = torch.arange(b * cache // page, dtype=torch.int32, device="cuda").view(b, -1)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def decode_int():
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cache)

    def decode_tensor():
        flashtile.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

    def decode_paged():
        flashtile.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, block_table=table)

    def decode_append():
        flashtile.flash_attn_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=seqlens)

    def sdpa_cudnn_decode():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    return [decode_int, decode_tensor, decode_paged, decode_append, sdpa_cudnn_decode]


def host_us(fn, calls=200, rounds=5):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def profile(fn, top: int, calls=300):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    _problem.CHECK_VALUES = False
    print(torch.cuda.get_device_name(), torch.__version__)
    fns = dense_calls() + decode_calls()
    if args.only:
        fns = [f for f in fns if f.__name__ in args.only.split(",")]
    for fn in fns:
        print(f"{fn.__name__} {host_us(fn):.0f} us/call host", flush=True)
    if args.profile:
        for fn in fns:
            print("=====", fn.__name__)
            print(profile(fn, args.profile), flush=True)


if __name__ == "__main__":
    main()
