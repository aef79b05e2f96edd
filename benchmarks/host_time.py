"""Host time per call: how long the CPU spends issuing flashtile's kernels, on a problem too small to be GPU-bound.

    PYTHONPATH=. python benchmarks/host_time.py        (GPU machine)

Times 200 calls without synchronising (best of 5) of: launch.flash_bwd and launch.flash_fwd called directly (the
kernel launches and their host logic), flash_attn_func without autograd, and a training step (forward with
inputs that require grad, then backward). b1 n128 h4 d128 bf16, causal.
"""
import time

import torch

import flashtile
from flashtile.kernels.triton import launch as L


def main():
    torch.manual_seed(0)
    d = 128
    q, k, v = (torch.randn(1, 128, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    o, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out = o.detach()
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    p = L.AttnParams(softmax_scale=d ** -0.5, window_right=0)
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def bwd():
        L.flash_bwd(do, qd, kd, vd, out, lse, dq, dk, dv, p)

    def fwd():
        L.flash_fwd(qd, kd, vd, dq, lse, p)

    def api_nograd():
        with torch.no_grad():
            flashtile.flash_attn_func(q, k, v, causal=True)

    def api_grad():
        o = flashtile.flash_attn_func(q, k, v, causal=True)
        o.backward(do)

    print(torch.cuda.get_device_name(), torch.__version__)
    for fn in (bwd, fwd, api_nograd, api_grad):
        for _ in range(30):
            fn()
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                fn()
            best = min(best, (time.perf_counter() - t) / 200 * 1e6)
            torch.cuda.synchronize()
        print(fn.__name__, f"{best:.0f} us/call host", flush=True)


if __name__ == "__main__":
    main()
