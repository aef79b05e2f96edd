"""FP8 tile sweep and quantizer breakdown on one GPU (where flashtile.fp8.fp8_config's defaults come from).

    PYTHONPATH=. python benchmarks/sweep_fp8.py --out DIR

attention: the FP8 kernel (V^T, block quantization matching the tiles) at 16k tokens (b2 n8192), hidden 2048,
  for every (BLOCK_M, BLOCK_N, num_warps, num_stages) listed in cfgs(), d64/128/256, causal and full.
quantizer: one tensor of 16k tokens x 2048 through quant_fp8_kernel: plain (hardware cast / fp32 software
  rounding), rotated by butterflies or by the tensor-core product, and V^T, with 4 and 8 warps; beside torch's
  own x.to(float8_e4m3fn) for scale.
Compilation runs first in worker processes (one per CPU core, up to 15) that fill Triton's cache; the main
process then times everything with triton.testing.do_bench medians. Writes DIR/fp8_sweep.json and .log.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashtile.fp8 import FP8_DTYPE, FP8Config, _block_d, attention_fp8, quant_group, quantize_fp8  # noqa: E402
from flashtile.kernels.triton import fp8 as K  # noqa: E402
from flashtile.reference import fp8_emulation as E  # noqa: E402

TOK, SEQ = 16384, 8192


def cfgs():
    out = []
    for causal in (False, True):
        for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 256, 4), (128, 64, 8),
                          (128, 128, 8), (128, 256, 8), (256, 64, 8), (256, 128, 8)):
            for st in (2, 3, 4):
                out.append((64, causal, FP8Config(bm, bn, w, st)))
        for bm, bn, w in ((128, 128, 8), (128, 256, 8), (256, 128, 8), (64, 128, 4), (128, 128, 4)):
            for st in (2, 3, 4):
                out.append((128, causal, FP8Config(bm, bn, w, st)))
        for bm, bn, w in ((128, 128, 8), (128, 64, 8), (64, 128, 4), (64, 64, 4)):
            for st in (2, 3):
                out.append((256, causal, FP8Config(bm, bn, w, st)))
    return out


def qvariants():
    out = []
    for d in (64, 128, 256):
        for w in (4, 8):
            for name, inc, mma, soft, tr in (('plain_soft', False, False, True, False), ('plain', False, False, False, False),
                                             ('bfly', True, False, False, False), ('mma', True, True, False, False),
                                             ('vT', False, False, False, True)):
                out.append((d, w, name, inc, mma, soft, tr))
    return out


def inputs(d, seqlen=SEQ):
    h = 2048 // d
    b = TOK // seqlen
    g = torch.Generator(device='cuda').manual_seed(0)
    return tuple(torch.randn(b, seqlen, h, d, device='cuda', generator=g, dtype=torch.bfloat16) for _ in range(3))


def quant_call(x, block, w, inc, mma, soft, tr):
    b, n, h, d = x.shape
    bd = _block_d(d)
    nblk = triton.cdiv(n, block)
    scale = torch.empty(b, h, nblk, device=x.device, dtype=torch.float32)
    if tr:
        y = torch.empty(b, h, d, n, device=x.device, dtype=FP8_DTYPE)
        ystr = (y.stride(0), 1, y.stride(1), y.stride(2))
    else:
        y = torch.empty(b, n, h, d, device=x.device, dtype=FP8_DTYPE)
        ystr = (y.stride(0), y.stride(1), y.stride(2), 1)
    signs = E.hadamard_signs(d, 0, device=x.device)
    def fn():
        group = quant_group(nblk, b * h, x.device)
        K.quant_fp8_kernel[(triton.cdiv(nblk, group), b * h)](
            x, y, scale, signs, scale, x.stride()[:3], ystr, scale.stride()[:2], (h, n, d), 1.0 / math.sqrt(d),
            BLOCK=block, BLOCK_D=bd, INCOHERENT=inc, GROUP=group,
            PER_TENSOR=False, WRITE_Y=True, FWHT_MMA=mma, SOFT_ROUND=soft, num_warps=w)
        return y
    return fn


def worker(i, n):
    cache = {}
    jobs = [('a', c) for c in cfgs()] + [('q', v) for v in qvariants()]
    for j, (kind, c) in enumerate(jobs):
        if j % n != i:
            continue
        try:
            if kind == 'a':
                d, causal, cf = c
                key = (d, cf.BLOCK_M, cf.BLOCK_N)
                if key not in cache:
                    q, k, v = inputs(d)
                    cache[key] = quantize_fp8(q, k, v, block_m=cf.BLOCK_M, block_n=cf.BLOCK_N)
                attention_fp8(cache[key], softmax_scale=d ** -0.5, causal=causal, config=cf)
            else:
                d, w, name, inc, mma, soft, tr = c
                q, _, _ = inputs(d)
                quant_call(q, 128, w, inc, mma, soft, tr)()
            torch.cuda.synchronize()
        except Exception as e:
            print('compile fail', kind, c, type(e).__name__, str(e)[:300], flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    OUT = ap.parse_args().out
    os.makedirs(OUT, exist_ok=True)
    log = open(f'{OUT}/fp8_sweep.log', 'w')
    def P(*a):
        s = ' '.join(str(x) for x in a)
        print(s, flush=True); log.write(s + '\n'); log.flush()
    t0 = time.time()
    nw = max(1, min(15, (os.cpu_count() or 2) - 1))
    procs = [subprocess.Popen([sys.executable, __file__, '--worker', str(i), str(nw)]) for i in range(nw)]
    for p in procs:
        p.wait()
    P('compile done', round(time.time() - t0, 1), 's')
    res = {'quant': [], 'attn': []}
    for d in (64, 128, 256):
        q, _, _ = inputs(d)
        ref = triton.testing.do_bench(lambda: q.to(torch.float8_e4m3fn), return_mode='median')
        P(f'quant d{d} torch_cast_one {ref*1e3:.1f} us  ({q.numel()*3/ref/1e6:.0f} GB/s)')
        outs = {}
        for (dd, w, name, inc, mma, soft, tr) in qvariants():
            if dd != d:
                continue
            try:
                fn = quant_call(q, 128, w, inc, mma, soft, tr)
                outs[(w, name)] = fn().float().clone()
                ms = triton.testing.do_bench(fn, return_mode='median')
                r = {'d': d, 'w': w, 'name': name, 'us': ms * 1e3, 'GBps': q.numel() * 3 / ms / 1e6}
            except Exception as e:
                r = {'d': d, 'w': w, 'name': name, 'err': str(e)[:200]}
            res['quant'].append(r)
            P('quant', json.dumps(r))
        for w in (4, 8):
            if (w, 'plain') in outs and (w, 'plain_soft') in outs:
                P(f'  d{d} w{w} soft==hw cast: {torch.equal(outs[(w, "plain")], outs[(w, "plain_soft")])}',
                  f' bfly vs mma mismatch frac {(outs[(w, "bfly")] != outs[(w, "mma")]).float().mean().item():.2e}')
    cache = {}
    base = {}
    for d, causal, c in cfgs():
        try:
            key = (d, c.BLOCK_M, c.BLOCK_N)
            if key not in cache:
                qq, kk, vv = inputs(d)
                cache[key] = quantize_fp8(qq, kk, vv, block_m=c.BLOCK_M, block_n=c.BLOCK_N)
            t = cache[key]
            fn = lambda: attention_fp8(t, softmax_scale=d ** -0.5, causal=causal, config=c)
            o, _ = fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode='median')
            b = TOK // SEQ; h = 2048 // d
            fl = 4 * SEQ * SEQ * d * h * b * (0.5 if causal else 1.0)
            r = {'d': d, 'causal': causal, 'cfg': list(c.__dict__.values()), 'ms': ms, 'tflops': fl / ms / 1e9}
            if (d, causal) in base:   # other tiles quantize in other blocks: differences of e4m3 size
                r['maxdiff_vs_first'] = (o.float() - base[(d, causal)]).abs().max().item()
            else:
                base[(d, causal)] = o.float()
        except Exception as e:
            r = {'d': d, 'causal': causal, 'cfg': list(c.__dict__.values()), 'err': f'{type(e).__name__}: {str(e)[:200]}'}
        res['attn'].append(r)
        P('attn', json.dumps(r))
    json.dump(res, open(f'{OUT}/fp8_sweep.json', 'w'), indent=1)
    P('\nSUMMARY top-3 TFLOP/s per (d, causal)')
    for d in (64, 128, 256):
        for causal in (False, True):
            rs = sorted([r for r in res['attn'] if r['d'] == d and r['causal'] == causal and 'tflops' in r], key=lambda r: -r['tflops'])
            P(f'd{d} causal={causal}: ' + ' | '.join(f"{r['tflops']:.0f} {r['cfg']} d={r.get('maxdiff_vs_first', 0):.1e}" for r in rs[:3]))
    P('total', round(time.time() - t0, 1), 's')


if __name__ == '__main__':
    if len(sys.argv) > 1 and sys.argv[1] == '--worker':
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
