"""Where a call's GPU time goes: every kernel one call launches, in launch order, with its median duration
(torch.profiler's CUDA activity, over --reps calls), beside cuDNN SDPA's kernels on the same problem.

Usage (GPU machine, repo root):
  PYTHONPATH=. python benchmarks/kernel_times.py bwd --headdim 256 --seqlen 2048 8192 16384 [--causal both]
  PYTHONPATH=. python benchmarks/kernel_times.py decode --batch 1 --cache 4096 32768 131072 [--page 256]

bwd: the FA3 grid's problem (16k tokens, hidden 2048, bf16), flash_attn_func's backward (o.backward(do)) and
SDPA-cuDNN's. decode: bench_decode.py's problem (nheads 32 / 8, d128, one query token, full cache), each call
replayed from a CUDA graph as bench_decode.py's "graph" column does. Each provider's output is checked against a
float32 reference first. Prints one table per problem: kernel, calls, median us, share of the call's kernel time.
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import flashtile  # noqa: E402
from flashtile.api import problem as _problem  # noqa: E402
from bench_decode import graphed, to_paged  # noqa: E402

DTYPE = torch.bfloat16


def kernel_table(fn, reps):
    """[(kernel name, [durations us])] in the launch order of one call of fn, from `reps` profiled calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    kernels.sort(key=lambda e: e.time_range.start)
    per_call = len(kernels) // reps
    rows = []
    for pos in range(per_call):
        ks = kernels[pos::per_call]
        rows.append((ks[0].name[:90], [k.time_range.elapsed_us() for k in ks]))
    return rows


def print_table(title, rows):
    total = sum(statistics.median(d) for _, d in rows)
    print(f"\n#### {title}: {total:.1f} us of kernel time per call")
    print("| # | kernel | median us | share |")
    print("|---:|---|---:|---:|")
    for i, (name, d) in enumerate(rows):
        med = statistics.median(d)
        print(f"| {i} | `{name}` | {med:.1f} | {100 * med / total:.0f}% |")
    return total


def run_bwd(args):
    for d in args.headdim:
        h = 2048 // d
        for n in args.seqlen:
            b = max(1, 16384 // n)
            for causal in ([False, True] if args.causal == "both" else [args.causal == "true"]):
                q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
                do = torch.randn(b, n, h, d, device="cuda", dtype=DTYPE)
                o = flashtile.flash_attn_func(q, k, v, causal=causal)
                qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    ot = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                # the two backwards agree (cuDNN is checked against float64 by flashtile bench)
                gf = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                gc = torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
                err = max(((a.float() - c.transpose(1, 2).float()).norm() / c.float().norm()).item()
                          for a, c in zip(gf, gc))
                flops = 2.5 * 4 * n * n * d * h * b / (2 if causal else 1)
                title = f"d{d} n{n} b{b} h{h} {'causal' if causal else 'full'} backward (rel. diff to cuDNN {err:.1e})"
                for name, out, ins in (("flashtile", o, (q, k, v)), ("cudnn", ot, (qt, kt, vt))):
                    g = do if name == "flashtile" else do.transpose(1, 2)
                    rows = kernel_table(lambda: torch.autograd.grad(out, ins, g, retain_graph=True), args.reps)
                    total = print_table(f"{name}: {title}", rows)
                    print(f"{name}: {flops / total / 1e6:.1f} TFLOP/s of kernel time")


def run_decode(args):
    H, HK, D = 32, 8, 128
    _problem.CHECK_VALUES = False
    for batch in args.batch:
        for s in args.cache:
            q = torch.randn(batch, 1, H, D, dtype=DTYPE, device="cuda")
            kc = torch.randn(batch, s, HK, D, dtype=DTYPE, device="cuda")
            vc = torch.randn(batch, s, HK, D, dtype=DTYPE, device="cuda")
            kp, vp, table = to_paged(kc, vc, args.page)
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
            ref = cudnn().float()
            kv_bytes = 2 * batch * s * HK * D * 2
            for name, fn in (("flashtile-contig", lambda: flashtile.flash_attn_with_kvcache(q, kc, vc)),
                             (f"flashtile-paged{args.page}",
                              lambda: flashtile.flash_attn_with_kvcache(q, kp, vp, block_table=table)),
                             ("cudnn", cudnn)):
                err = (fn().float() - ref).abs().max().item()
                assert err < 2e-2, (name, err)
                total = print_table(f"{name}: decode b{batch} cache {s} (graph replay; max diff to cuDNN {err:.1e})",
                                    kernel_table(graphed(fn), args.reps))
                print(f"{name}: {kv_bytes / total / 1e3:.0f} GB/s of kernel time")
            del kc, vc, kp, vp
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bwd")
    b.add_argument("--headdim", type=int, nargs="+", default=[256])
    b.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192, 16384])
    b.add_argument("--causal", choices=["true", "false", "both"], default="both")
    b.add_argument("--reps", type=int, default=20)
    dd = sub.add_parser("decode")
    dd.add_argument("--batch", type=int, nargs="+", default=[1])
    dd.add_argument("--cache", type=int, nargs="+", default=[4096, 32768, 131072])
    dd.add_argument("--page", type=int, default=256)
    dd.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    run_bwd(args) if args.what == "bwd" else run_decode(args)


if __name__ == "__main__":
    main()
