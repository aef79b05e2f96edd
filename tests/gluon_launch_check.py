"""The Gluon kernels' launches as flashtile's host code makes them (fa3.fwd, fa3.bwd, paged.decode_paged), through
Triton's own JIT launch path (argument binding, specialization, cache key, compile) on a machine without a GPU: a
stand-in driver reports an sm_90 device, the calls get CPU tensors, and relaunch.launch becomes kernel.warmup, which
compiles and launches nothing. Prints `ok <n> <kernel> wgmma=<count>` per launch and `done <n>` (PTX_DIR set:
also writes each launch's PTX there). The compile check (fa3_compile_check.py) builds the kernels' arguments
itself; this one checks the host code's argument lists and constexpr groups against the kernels under the JIT's
binder. Run by tests/test_fa3_gluon.py in a subprocess."""
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class _Sm90Driver:
    """The active driver, but for the target, device and stream of an sm_90 GPU."""
    def __init__(self, real):
        self.real = real

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):
        return getattr(self.real, name)


try:
    _real = driver.active
except Exception:  # noqa: BLE001   (no GPU driver on this machine)
    _real = None
driver.set_active(_Sm90Driver(_real))

from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from flashtile.kernels import relaunch  # noqa: E402
from flashtile.kernels.gluon import _decode, _fa3_bwd, _fa3_bwd_any, _fa3_fwd, fa3, paged  # noqa: E402
from flashtile.kernels.params import AttnParams  # noqa: E402

fa3._kernels = lambda index: (_fa3_fwd, fa3._Backward(_fa3_bwd.fa3_bwd_kernel, _fa3_bwd_any.fa3_bwd_any_kernel),
                              TensorDescriptor)
fa3._device_index = lambda t: 0
fa3._sm_count = lambda index: 132
fa3.tickets = lambda device, n: torch.zeros(n, dtype=torch.int32)
paged._on_gpu = lambda q: True
paged._kernel = lambda index: (_decode, TensorDescriptor)
_count = [0]


def _warmup(kernel, grid, args, kwargs):
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
    tile = kwargs.get("TILE")
    shape = f" tile={tile.HEAD_D}x{tile.BLOCK_M}" if hasattr(tile, "BLOCK_M") else ""   # (head dim x Br)
    if kwargs.get("SPLIT", 1) > 1:   # (programs per KV head of the dense backward)
        shape += f" split={kwargs['SPLIT']}"
    if kwargs.get("HEADS"):        # (the dense backward's query heads per program as a constexpr: fa3.BWD_GQA_HEADS)
        shape += f" heads={kwargs['HEADS']}"
    if getattr(kwargs.get("FEATURES"), "SAME_SEQS", False):   # (one cu_seqlens for queries and keys: BWD_SAME_SEQS)
        shape += " same"
    print(f"ok {_count[0]} {name} wgmma={compiled.asm['ptx'].count('wgmma.mma_async')}{shape}", flush=True)
    if os.environ.get("PTX_DIR"):   # (the PTX of each launch, for comparing two trees)
        with open(os.path.join(os.environ["PTX_DIR"], f"{_count[0]:02d}_{name}.ptx"), "w") as f:
            f.write(compiled.asm["ptx"])
    _count[0] += 1


relaunch.launch = _warmup
relaunch.bind = lambda *a, **k: None   # (no launch template: there is no launch)
BF16 = torch.bfloat16
FULL = AttnParams(softmax_scale=0.1)
CAUSAL = AttnParams(softmax_scale=0.1, window_right=0)


def _rand(*shape):
    return torch.randn(*shape, dtype=BF16)


def _tensors(b, sq, sk, h, hk, d, cu, max_len):
    """q, k, v, lse and the varlen arguments of one problem (dense (b, s, h, d), or varlen (tokens, h, d))."""
    if cu is None:
        return _rand(b, sq, h, d), _rand(b, sk, hk, d), _rand(b, sk, hk, d), torch.empty(b, h, sq), {}
    lens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)
    return _rand(sq, h, d), _rand(sk, hk, d), _rand(sk, hk, d), torch.empty(h, sq), lens


def _fwd_bwd(params, b=2, sq=1024, sk=1024, h=4, hk=2, d=128, alibi=None, cu=None, max_len=None, **flex):
    """fa3.fwd then fa3.bwd of one problem (dense (b, s, h, d), or varlen (tokens, h, d) with cu_seqlens)."""
    q, k, v, lse, lens = _tensors(b, sq, sk, h, hk, d, cu, max_len)
    fa3.fwd(q, k, v, torch.empty_like(q), lse, params, alibi, **lens, **flex)
    fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse), torch.empty_like(q), torch.empty_like(k),
            torch.empty_like(v), params, alibi=alibi, **lens, **flex)


def _bwd_into_sums(params, b=2, sq=1024, sk=1024, h=4, hk=2, d=128, cu=None, max_len=None):
    """fa3.bwd as the ring's steps call it (params.GradSums): dQ added into a float32 running sum, dK and dV written
    in float32."""
    q, k, v, lse, lens = _tensors(b, sq, sk, h, hk, d, cu, max_len)
    fa3.bwd(torch.randn_like(q), q, k, v, lse, torch.randn_like(lse), None, torch.zeros(k.shape),
            torch.zeros(v.shape), params, torch.zeros(q.shape), **lens)


def _flex_fwd_bwd():
    """flashtile.flex's features through fa3.fwd / fa3.bwd: a block mask's lists with a score_mod (ALiBi's, its
    slopes wanting a gradient) and a mask_mod (document's)."""
    from flashtile import flex
    from flashtile.blocksparse import create_block_mask
    from flashtile.kernels.params import SparseLists, UserMods
    b, h, s, d = 2, 4, 512, 128
    score = flex.alibi_score(torch.rand(h))
    mask_mod = flex.document_mask(torch.zeros(s, dtype=torch.int32))
    bm = create_block_mask(lambda b_, h_, q, kv: kv <= q, None, None, s, s, BLOCK_SIZE=128, device="cpu")
    sparse = SparseLists(128, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                         bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
    mods = UserMods(score.fn, score.grad_fn, score.captured_grad_fn, score.captured, mask_mod.fn, mask_mod.captured,
                    (torch.zeros(h), ))
    _fwd_bwd(FULL, b=b, sq=s, sk=s, h=h, hk=h, d=d, sparse=sparse, mods=mods)


if __name__ == "__main__":
    _fwd_bwd(FULL)                                        # the dense backward kernel
    _fwd_bwd(CAUSAL, d=64)
    min_work, fa3.GQA_SPLIT_MIN_WORK = fa3.GQA_SPLIT_MIN_WORK, 0
    _fwd_bwd(CAUSAL, h=8, hk=2)   # GQA, the group's heads split over programs adding dK, dV in float32
    fa3.GQA_SPLIT_MIN_WORK = min_work
    _fwd_bwd(AttnParams(softmax_scale=0.1, window_left=100, window_right=20), sq=1000, sk=1100)   # the general one
    _fwd_bwd(AttnParams(softmax_scale=0.1, softcap=30.0), alibi=torch.rand(4))
    _fwd_bwd(CAUSAL, sq=1024, sk=1024, hk=4, cu=torch.tensor([0, 300, 1024], dtype=torch.int32), max_len=724)
    _fwd_bwd(CAUSAL, sq=1024, sk=1024, hk=4, d=64, cu=torch.tensor([0, 300, 1024], dtype=torch.int32), max_len=724)
    # varlen without a mask rule at d128: every step bounds its keys, no skip path (fa3.BWD_TAIL_EVERY_STEP)
    _fwd_bwd(FULL, sq=1024, sk=1024, hk=4, cu=torch.tensor([0, 300, 1024], dtype=torch.int32), max_len=724)
    _fwd_bwd(CAUSAL, sq=512, sk=512, hk=4, bias=_rand(1, 4, 512, 512), mask=torch.rand(2, 1, 512, 512) > 0.2)
    _flex_fwd_bwd()
    _bwd_into_sums(FULL)                                  # float32 dK / dV: the dense kernel, d128 and d64
    _bwd_into_sums(CAUSAL, d=64)
    _bwd_into_sums(CAUSAL, sq=1024, sk=1024, hk=4, cu=torch.tensor([0, 300, 1024], dtype=torch.int32), max_len=724)
    _bwd_into_sums(CAUSAL, sq=1024, sk=1024, hk=4, d=64, cu=torch.tensor([0, 300, 1024], dtype=torch.int32),
                   max_len=724)   # (the general kernel at d64 with float32 dK / dV: BWD_CONFIGS' tiles)
    for d, causal in ((128, False), (64, True)):          # the FP8 forward: e4m3 Q, K, V^T, per-block descales
        block_m, block_n = fa3.fp8_block_shape(d)
        q8, k8 = (torch.randn(2, 512, 4, d).to(torch.float8_e4m3fn) for _ in range(2))
        vt8 = torch.randn(2, 4, d, 512).to(torch.float8_e4m3fn)
        scales = (torch.rand(2, 4, 512 // block_m), torch.rand(2, 4, 512 // block_n), torch.rand(2, 4, 512 // block_n))
        fa3.fwd_fp8(q8, k8, vt8, *scales, torch.empty(2, 512, 4, d, dtype=BF16), torch.empty(2, 4, 512), 0.1, causal)
    for page, splits in ((16, 4), (32, 1)):               # split with the fused merge; one split
        q = _rand(2, 1, 8, 128)
        paged.decode_paged(q, _rand(64, page, 2, 128), _rand(64, page, 2, 128), torch.empty_like(q),
                           torch.empty(2, 8, 1), torch.tensor([100, 300], dtype=torch.int32), 0,
                           torch.arange(64, dtype=torch.int32).view(2, 32), CAUSAL, splits, lambda block_n: splits,
                           lambda n: torch.zeros(n, dtype=torch.int32), True, None)
    print(f"done {_count[0]}", flush=True)
    sys.exit(0)
