"""Compiles the Gluon FA3 forward (flashtile/kernels/gluon/_fa3_fwd.py) for sm_90 on a machine without a GPU and
prints one line per variant: `ok d<head_dim> causal=<0|1> <dtype> shared=<bytes> wgmma=<count> arrives=<count>
unsynced=<count>`. `unsynced` counts the plain mbarrier arrivals (one thread of a consumer warpgroup) not
preceded by a bar.sync of the warpgroup's 128 threads, on which the kernel's barrier counts rely (_pass_turn).
Run by tests/test_fa3_gluon.py in a subprocess, with TRITON_INTERPRET=0 (the interpreter does not run Gluon)."""
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from flashtile.kernels.gluon import _fa3_fwd, fa3  # noqa: E402


def compile_variant(head_dim: int, causal: bool, dtype: torch.dtype):
    num_wg, block_n, stages = fa3.CONFIGS[head_dim]
    b, s, h = 2, 1024, 4
    t = torch.randn(b * s, h * head_dim, dtype=dtype)

    def desc(rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, head_dim],
                                fa3._smem_layout(rows, head_dim, dtype))

    lse = torch.empty(b, h, s)
    runtime = dict(q_desc=desc(fa3.WG_ROWS), k_desc=desc(block_n), v_desc=desc(block_n), o_desc=desc(fa3.WG_ROWS),
                   lse_ptr=lse, stride_lse_b=lse.stride(0), stride_lse_h=lse.stride(1), seqlen_q=s, seqlen_k=s,
                   nheads=h, group=1)
    consts = dict(HEAD_D=head_dim, BLOCK_M=fa3.WG_ROWS, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal,
                  NUM_WG=num_wg, PINGPONG=fa3.PINGPONG[head_dim][causal], num_warps=4)
    kernel = _fa3_fwd.fa3_fwd_kernel
    signature, constexprs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.name in consts:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = consts[p.name]
        elif p.name == "qk_scale":
            signature[p.name] = "fp32"
        else:
            signature[p.name] = mangle_type(runtime[p.name])
    return triton.compile(GluonASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=fa3.MAXNREG))


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        d, causal, dt = spec.split(",")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        ck = compile_variant(int(d), causal == "1", dtype)
        ptx = ck.asm["ptx"].splitlines()
        arrives = [i for i, line in enumerate(ptx) if "mbarrier.arrive" in line and "expect_tx" not in line]
        unsynced = [i for i in arrives if not any("bar.sync" in ptx[j] and ", 128;" in ptx[j]
                                                  for j in range(max(0, i - 6), i))]
        print(f"ok d{d} causal={causal} {dt} shared={ck.metadata.shared} "
              f"wgmma={ck.asm['ptx'].count('wgmma.mma_async')} arrives={len(arrives)} unsynced={len(unsynced)}",
              flush=True)
