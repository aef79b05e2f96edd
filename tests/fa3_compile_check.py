"""Compiles the Gluon FA3 kernels (flashtile/kernels/gluon/_fa3_fwd.py, _fa3_bwd.py) for sm_90 on a machine
without a GPU. Arguments `fwd|fwdshort|bwd|fp8|paged,<head_dim>,<causal 0|1>,<bf16|fp16>[,<seqlen>]` (fwdshort: the
forward's config at sequences of that length, default 1: fa3.SHORT_CONFIGS; fwdx / bwdx: the forward / backward
with the features of its third field, '+'-joined FEATURES, FLEX (the forward) and 'causal', on; fp8: e4m3 inputs, that output dtype;
paged: the paged decode (gluon/_decode.py) for
pages of <seqlen> keys, printing `ok paged ... page=<keys> shared=<bytes> wgmma=<count> tma=<count>`);
prints one line per variant:
`ok <kind> d<head_dim> causal=<0|1, fwdx: its features> <dtype> shared=<bytes> wgmma=<count> reduce=<count> arrives=<count>
unsynced=<count> e4m3_mma=<count> shfl_idx=<count>` (reduce: TMA reduce-add instructions, the backward's dQ;
e4m3_mma: FP8 wgmmas; shfl_idx: indexed warp shuffles, which a P operand needing data exchange would bring).
`unsynced` counts the plain mbarrier arrivals (one thread of a consumer warpgroup, or of the forward's one-warp
producer) not preceded by a bar.sync of the warpgroup's 128 threads (the producer's: of its warp), on which the
kernels' barrier counts rely (_fa3_fwd._pass_turn, the backward's ds_ready / ds_free / qdo_empty).
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

from flashtile.kernels.gluon import _fa3_bwd, _fa3_fwd, fa3  # noqa: E402
from flashtile.kernels.params import AttnParams, Features  # noqa: E402


def _compile(kernel, runtime: dict, consts: dict, maxnreg=fa3.MAXNREG):
    signature, constexprs = {}, {}
    for i, p in enumerate(kernel.params):
        if p.name in consts:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = consts[p.name]
        elif isinstance(runtime[p.name], float):
            signature[p.name] = "fp32"
        else:
            signature[p.name] = mangle_type(runtime[p.name])
            # (a tuple's elements equal to 1, at any depth, specialize as constants, as at a launch)
            constexprs.update(_tuple_constants(signature[p.name], runtime[p.name], (i, )))
    return triton.compile(GluonASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, **({} if maxnreg is None else dict(maxnreg=maxnreg))))


def _tuple_constants(sig, value, path):
    """{path: value} of the elements of a tuple argument that its signature marks constexpr."""
    if not isinstance(value, tuple):
        return {path: value} if sig == "constexpr" and len(path) > 1 else {}
    out = {}
    for j, (s, x) in enumerate(zip(sig, value)):
        out.update(_tuple_constants(s, x, (*path, j)))
    return out


def _desc(t, rows, cols):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, cols], fa3._smem_layout(rows, cols, t.dtype))


FEATURES = ("varlen", "left", "right", "softcap", "alibi", "tail", "guard")
_FLAGS = dict(zip(FEATURES, ("VARLEN", "HAS_LEFT", "HAS_RIGHT", "SOFTCAP", "ALIBI", "TAIL", "GUARD")))


def _fwd_runtime(q, k, v, o, lse, block_n, head_dim, h, s, fp8=False):
    """fa3_fwd_kernel's runtime arguments over 2-D (rows, heads x d) tensors."""
    i32 = torch.zeros(3, dtype=torch.int32)
    return dict(q_desc=_desc(q, fa3.WG_ROWS, head_dim), k_desc=_desc(k, block_n, head_dim),
                v_desc=_desc(v, head_dim, block_n) if fp8 else _desc(v, block_n, head_dim),
                o_desc=_desc(o, fa3.WG_ROWS, head_dim), lse_ptr=lse, q_scale_ptr=lse, k_scale_ptr=lse,
                v_scale_ptr=lse, counter_ptr=torch.zeros(1, dtype=torch.int32), out_ptr=o, cu_seqlens_q=i32,
                cu_seqlens_k=i32, alibi_ptr=torch.zeros(h), strides=(lse.stride(0), lse.stride(1), o.stride(0), 0),
                sizes=(s, s, 2 * h, h, 1), scales=(0.1, 0.5), window=(64, 0))


# the forward's flashtile.flex features (fwdx): a score_mod, a mask_mod, attn_bias, a bool mask, a block mask
FLEX = ("scoremod", "maskmod", "bias", "mask", "sparse")


def _flex_runtime(lse, features, b, h, s, backward=False):
    """fa3_fwd_kernel's (backward: fa3_bwd_any_kernel's) flex arguments and constexprs (fa3.flex_args) for the FLEX
    features named; the score_mod (ALiBi's) with its captured slopes' gradient in the backward."""
    from flashtile import flex
    from flashtile.blocksparse import create_block_mask
    from flashtile.kernels.params import SparseLists, UserMods
    score = flex.alibi_score(torch.zeros(h)) if "scoremod" in features else None
    mask_mod = flex.document_mask(torch.zeros(s, dtype=torch.int32)) if "maskmod" in features else None
    mods = None
    if score is not None or mask_mod is not None:
        mods = UserMods(score and score.fn, score and score.grad_fn, score and score.captured_grad_fn,
                        score and score.captured, mask_mod and mask_mod.fn, mask_mod and mask_mod.captured,
                        score and backward and (torch.zeros(h), ))
    sparse = None
    if "sparse" in features:
        bm = create_block_mask(lambda b_, h_, q, kv: kv <= q, None, None, 256, 256, BLOCK_SIZE=128, device="cpu")
        sparse = SparseLists(128, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                             bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
    bias = torch.zeros(1, h, s, s, dtype=torch.bfloat16) if "bias" in features else None
    mask = torch.ones(s, s, dtype=torch.bool)[None, None] if "mask" in features else None
    runtime, consts = fa3.flex_args(lse, b, h, s, s, bias, mask, sparse, mods, backward)
    return runtime, consts, sparse


def compile_fwd(head_dim: int, causal: bool, dtype: torch.dtype, seqlen: int = 1 << 20, features=()):
    """The bf16 / fp16 forward as fa3.fwd launches it at this sequence length (fa3.fwd_config), with the feature
    flags named in `features` (FEATURES) on; causal: HAS_RIGHT, the causal config."""
    num_wg, block_n, stages, pingpong = fa3.fwd_config(head_dim, seqlen, causal, "alibi" in features,
                                                       any(f in FLEX for f in features))
    b, s, h = 2, 1024, 4
    t = torch.randn(b * s, h * head_dim, dtype=dtype)
    lse = torch.empty(b, h, s)
    runtime = _fwd_runtime(t, t, t, t, lse, block_n, head_dim, h, s)
    runtime["flex"], flex_consts, sparse = _flex_runtime(lse, features, b, h, s)
    launch = fa3._regs(head_dim, False, num_wg)
    flags = {_FLAGS[f]: f in features for f in FEATURES if f in _FLAGS}
    flags["HAS_RIGHT"] = flags["HAS_RIGHT"] or causal
    if any(f in FLEX for f in features):   # (fa3.fwd_features)
        flags.update(GUARD=True, TAIL=flags["TAIL"] or sparse is not None)
    tile = fa3.FwdTile(head_dim, fa3.WG_ROWS, block_n, stages, num_wg,
                       fa3.q_buffers(head_dim, num_wg, block_n, stages, t.element_size(), False), pingpong, False)
    consts = dict(TILE=tile, FEATURES=Features(**flags), FLEX=flex_consts, CONSUMER_REGS=launch["CONSUMER_REGS"],
                  num_warps=4)
    return _compile(_fa3_fwd.fa3_fwd_kernel, runtime, consts, launch["maxnreg"])


def compile_fp8(head_dim: int, causal: bool, out_dtype: torch.dtype):
    """The FP8 forward as fa3.fwd_fp8 launches it: e4m3 Q, K and V^T, a 16-bit output, per-block descales."""
    block_m, block_n = fa3.fp8_block_shape(head_dim)
    b, s, h = 2, 1024, 4
    x8 = torch.randn(b * s, h * head_dim).to(torch.float8_e4m3fn)
    vt = torch.randn(b * h * head_dim, s).to(torch.float8_e4m3fn)
    out = torch.empty(b * s, h * head_dim, dtype=out_dtype)
    lse = torch.empty(b, h, s)
    runtime = _fwd_runtime(x8, x8, vt, out, lse, block_n, head_dim, h, s, fp8=True)
    runtime["flex"], flex_consts, _ = _flex_runtime(lse, (), b, h, s)
    num_wg, _, stages = fa3.FP8_CONFIGS[head_dim]
    launch = fa3._regs(head_dim, True, num_wg)
    tile = fa3.FwdTile(head_dim, fa3.WG_ROWS, block_n, stages, num_wg,
                       fa3.q_buffers(head_dim, num_wg, block_n, stages, 1, True), fa3.FP8_PINGPONG[head_dim][causal],
                       True)
    consts = dict(TILE=tile, FEATURES=Features(HAS_RIGHT=causal), FLEX=flex_consts,
                  CONSUMER_REGS=launch["CONSUMER_REGS"], num_warps=4)
    return _compile(_fa3_fwd.fa3_fwd_kernel, runtime, consts, launch["maxnreg"])


def compile_bwd(head_dim: int, causal: bool, dtype: torch.dtype, features=()):
    """The backward as fa3.bwd launches it (tiles and turns from fa3.bwd_config, dQ tile as fa3.bwd chooses it, dK /
    dV stored by TMA): the dense kernel, or with `features` (FEATURES but guard) fa3_bwd_any_kernel with those flags
    on; causal: HAS_RIGHT."""
    b, s, h = 2, 1024, 4
    # (the problem's mask rule, softcap and ALiBi as the features name them: they pick the general kernel's tiles)
    params = AttnParams(softmax_scale=0.1, window_left=64 if "left" in features else -1,
                        window_right=0 if causal or "right" in features else -1,
                        softcap=30.0 if "softcap" in features else 0.0)
    alibi = torch.zeros(h) if "alibi" in features else None
    (block_m, block_n, stages), pingpong = fa3.bwd_config(head_dim, params, alibi, not features, False,
                                                          any(f in FLEX for f in features))
    t = torch.randn(b * s, h * head_dim, dtype=dtype)
    dq = torch.zeros(b * s, h * head_dim)
    lse = torch.empty(b, h, s)
    dq_tile = fa3.bwd_dq_tile(block_m, head_dim)
    runtime = dict(k_desc=_desc(t, block_n, head_dim), v_desc=_desc(t, block_n, head_dim),
                   q_desc=_desc(t, block_m, head_dim), do_desc=_desc(t, block_m, head_dim),
                   dq_desc=_desc(dq, *dq_tile), lse_ptr=lse, delta_ptr=lse,
                   dk_desc=_desc(t, block_n // 2, head_dim), dv_desc=_desc(t, block_n // 2, head_dim))
    tile = fa3.BwdTile(head_dim, block_m, block_n, stages, pingpong)
    consts = dict(TILE=tile, P_LAYOUT=fa3._smem_layout(block_m, block_n // 2, dtype), num_warps=4)
    if not features:
        runtime.update(lse_strides=(lse.stride(0), lse.stride(1)), sizes=(s, s, h, 1), scales=(0.1, 0.1))
        return _compile(_fa3_bwd.fa3_bwd_kernel, runtime, dict(consts, CAUSAL=causal, SPLIT=1, HEADS=0))
    from flashtile.kernels.gluon import _fa3_bwd_any
    i32 = torch.zeros(3, dtype=torch.int32)
    runtime.update(dk_ptr=t, dv_ptr=t, cu_seqlens_q=i32, cu_seqlens_k=i32, alibi_ptr=torch.zeros(h),
                   strides=(lse.stride(0), lse.stride(1), t.stride(0), t.stride(0), 0), sizes=(s, s, h, 1),
                   scales=(0.1, 0.1, 0.5), window=(64, 0))
    flags = {_FLAGS[f]: f in features for f in FEATURES if f != "guard"}
    flags["HAS_RIGHT"] = flags["HAS_RIGHT"] or causal
    flex_rt, flex_consts, sparse = _flex_runtime(lse, features, b, h, s, backward=True)
    runtime["flex"] = (*flex_rt, torch.zeros(16, dtype=torch.int32))   # (order_ptr last)
    flex = any(f in FLEX for f in features)
    flags["TAIL"] = flags["TAIL"] or sparse is not None
    ours = fa3.bwd_features(params, flags["VARLEN"], alibi, s, s, block_m, block_n, flex, sparse is not None,
                            head_dim)
    flags.update(SKIP=ours.SKIP or flags["TAIL"], EMPTY=ours.EMPTY or flags["TAIL"],
                 MASK_EVERY_STEP=ours.MASK_EVERY_STEP)
    return _compile(_fa3_bwd_any.fa3_bwd_any_kernel, runtime, dict(consts, FEATURES=Features(**flags),
                                                                  FLEX=flex_consts, HEADS=0))


def compile_paged(head_dim: int, causal: bool, dtype: torch.dtype, page: int):
    """The paged decode (gluon/_decode.py) as paged.decode_paged launches it for pages of `page` keys (its
    PAGE_CONFIGS entry); causal launches write split partials and merge them (the fused combine), the others the
    output (both epilogues compiled)."""
    from flashtile.kernels.gluon import _decode, paged
    block_n, stages = paged.PAGE_CONFIGS[page]
    cache = torch.randn(64 * page, 8 * head_dim, dtype=dtype)
    q = torch.randn(2, 1, 32, head_dim, dtype=dtype)
    i32 = torch.zeros(2, dtype=torch.int32)
    part, lse_part = torch.empty(3, 2, 32, head_dim), torch.empty(3, 2, 32)
    runtime = dict(q_ptr=q, k_desc=_desc(cache, page, head_dim), v_desc=_desc(cache, page, head_dim), o_ptr=q,
                   lse_ptr=torch.empty(2, 32, 1), o_part_ptr=part if causal else q,
                   lse_part_ptr=lse_part if causal else q, sem_ptr=i32 if causal else q, bt_ptr=i32,
                   seqlens_ptr=i32, score_scale=0.1, q_strides=(1, 1, 1), o_strides=(1, 1, 1), lse_strides=(1, 1),
                   part_strides=(1, 1, 1, 1, 1), stride_bt=1, sizes=(1, 1, 1, 1, 1))
    consts = dict(HEAD_D=head_dim, PAGE=page, BLOCK_N=block_n, STAGES=stages, HAS_SEQLENS=True, CAUSAL=causal,
                  SPLIT=causal, FUSED=causal)
    return _compile(_decode.paged_decode_kernel, runtime, consts, maxnreg=None)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        kind, d, causal, dt, *seqlen = spec.split(",")   # seqlen: fwdshort's (default 1)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
        short_len = int(seqlen[0]) if seqlen else 1
        if kind == "paged":   # the fifth field: the page size
            ck = compile_paged(int(d), causal == "1", dtype, int(seqlen[0]))
            print(f"ok paged d{d} causal={causal} {dt} page={seqlen[0]} shared={ck.metadata.shared} "
                  f"wgmma={ck.asm['ptx'].count('wgmma.mma_async')} "
                  f"tma={ck.asm['ptx'].count('cp.async.bulk.tensor')}", flush=True)
            continue
        if kind in ("fwdx", "bwdx"):   # the third field: '+'-joined FEATURES (causal: 'right', the causal config)
            feats = tuple(f for f in causal.split("+") if f and f != "causal")
            ck = (compile_fwd if kind == "fwdx" else compile_bwd)(int(d), "causal" in causal.split("+"), dtype,
                                                                  features=feats)
        else:
            ck = {"fwd": compile_fwd, "bwd": compile_bwd, "fp8": compile_fp8,
                  "fwdshort": lambda d, c, t: compile_fwd(d, c, t, seqlen=short_len)}[kind](int(d), causal == "1",
                                                                                         dtype)
        ptx = ck.asm["ptx"].splitlines()
        arrives = [i for i, line in enumerate(ptx) if "mbarrier.arrive" in line and "expect_tx" not in line]
        unsynced = [i for i in arrives if not any(("bar.sync" in ptx[j] and ", 128;" in ptx[j])
                                                  or "bar.warp.sync" in ptx[j] for j in range(max(0, i - 6), i))]
        print(f"ok {kind} d{d} causal={causal} {dt} shared={ck.metadata.shared} "
              f"wgmma={ck.asm['ptx'].count('wgmma.mma_async')} reduce={ck.asm['ptx'].count('cp.reduce.async.bulk')} "
              f"arrives={len(arrives)} unsynced={len(unsynced)} e4m3_mma={ck.asm['ptx'].count('.f32.e4m3.e4m3')} "
              f"shfl_idx={ck.asm['ptx'].count('shfl.sync.idx')}", flush=True)
