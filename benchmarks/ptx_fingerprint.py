"""PTX fingerprints of flashtile's kernels, made on a machine without a GPU: a refactor check.

    TRITON_INTERPRET=0 PYTHONPATH=<tree> python benchmarks/ptx_fingerprint.py > <tree>.txt   # then diff two trees

Runs a few flashtile calls on CPU tensors (dense forward/backward at d64/128/256, causal and full; block-sparse
forward/backward; decode contiguous, paged, paged with left padding and softcap, batch 1 and 8) with every
kernel launch intercepted, compiles each launch for sm_90 (the GPU configs and TMA descriptors, as on an H100 /
H200) and prints a hash of its PTX without line information. Equal hashes on two trees: the change did not alter
the generated code. PTX_DUMP=<dir> also writes each hashed PTX there (to diff where hashes differ). Patches flashtile's device checks and Triton's launcher in this process only."""
import hashlib, os, warnings
warnings.filterwarnings("ignore")
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import torch, triton
import triton.runtime.jit as J
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from triton.tools.tensor_descriptor import TensorDescriptor
import flashtile
from flashtile.kernels.triton import launch as L, decode as D

captured = []
def fake_run(self, *args, grid, warmup, **kwargs):
    captured.append((self, args, kwargs))
J.JITFunction.run = fake_run
L.interpreting = lambda: False
D.interpreting = lambda: False
import flashtile.interface as I, flashtile.kvcache as KV0
I._check_device = lambda q: None
KV0._check_device = lambda q: None

def kv_desc(t, block_n, block_d):
    head_dim, nheads = t.shape[-1], t.shape[-2]
    if block_d != head_dim:
        return None
    rows = t.shape[0] * t.shape[1] if t.dim() == 4 else t.shape[0]
    view = t.as_strided((rows, nheads * head_dim), (t.stride(-3), 1))
    return TensorDescriptor(view, [rows, nheads * head_dim], [t.stride(-3), 1], [block_n, block_d])
L.kv_descriptor = kv_desc
D._cache_descriptor = kv_desc

def compile_all(tag):
    out = []
    for kern, args, kwargs in captured:
        names = kern.arg_names
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        for p in kern.params:
            if p.name not in bound:
                bound[p.name] = p.default
        sig, consts = {}, {}
        for p in kern.params:
            v = bound[p.name]
            if p.is_constexpr or v is None or callable(v) and not isinstance(v, torch.Tensor):
                sig[p.name] = "constexpr"
                consts[p.name] = v
            elif isinstance(v, tuple):
                sig[p.name] = "constexpr"; consts[p.name] = v
            else:
                sig[p.name] = J.mangle_type(v)
        opts = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        try:
            c = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                               options=opts)
            ptx = c.asm["ptx"]
            ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
            lines = [l for l in ptx.splitlines() if not l.strip().startswith((".loc", ".file", "//", "$L__"))]
            h = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]
            if os.environ.get("PTX_DUMP"):  # the hashed text, one file per launch, to diff two trees' kernels
                os.makedirs(os.environ["PTX_DUMP"], exist_ok=True)
                name = f"{tag} {kern.fn.__name__} {len(out)}".replace(" ", "_").replace("=", "")
                open(os.path.join(os.environ["PTX_DUMP"], name + ".ptx"), "w").write("\n".join(lines))
        except Exception as e:
            h = f"ERR {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        out.append(f"{tag} {kern.fn.__name__} {opts} {h}")
    captured.clear()
    return out

res = []
bf = torch.bfloat16
def qkv(b, s, h, hk, d, rg=False):
    return [torch.randn(b, s, hh, d, dtype=bf).requires_grad_(rg) for hh in (h, hk, hk)]
for d in (64, 128, 256):
    for causal in (False, True):
        q, k, v = qkv(2, 1024, 4, 2, d, True)
        o = flashtile.flash_attn_func(q, k, v, causal=causal)
        o.backward(torch.randn_like(o))
        res += compile_all(f"dense d{d} causal={causal}")
from flashtile.blocksparse import create_block_mask, blocksparse_attn_func
q, k, v = qkv(1, 512, 2, 2, 64, True)
bm = create_block_mask(lambda b, h, qi, ki: (ki <= qi) | (ki < 64), 1, 2, 512, 512, BLOCK_SIZE=128, device="cpu")
captured.clear()
o = blocksparse_attn_func(q, k, v, bm)
o.backward(torch.randn_like(o))
res += compile_all("blocksparse")
from flashtile.kvcache import flash_attn_with_kvcache
import flashtile.kvcache as KV
KV.CHECK_VALUES = False
for batch in (1, 8):
    qd = torch.randn(batch, 1, 32, 128, dtype=bf)
    kc, vc = (torch.randn(batch, 4096, 8, 128, dtype=bf) for _ in range(2))
    flash_attn_with_kvcache(qd, kc, vc)
    res += compile_all(f"decode b{batch}")
    pages = torch.randperm(batch * 16).reshape(batch, 16).to(torch.int32)
    flash_attn_with_kvcache(qd, kc.reshape(-1, 256, 8, 128), vc.reshape(-1, 256, 8, 128), block_table=pages)
    res += compile_all(f"decode paged b{batch}")
    lp = torch.full((batch,), 64, dtype=torch.int32)
    flash_attn_with_kvcache(qd, kc.reshape(-1, 256, 8, 128), vc.reshape(-1, 256, 8, 128), block_table=pages,
                            cache_leftpad=lp, cache_seqlens=torch.full((batch,), 4000, dtype=torch.int32), causal=True,
                            softcap=5.0)
    res += compile_all(f"decode paged leftpad b{batch}")
print("\n".join(res))
