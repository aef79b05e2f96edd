"""FP8 attention (FA3 §3.3): quantization kernel, attention kernel, API, and FA3 Table 3's accuracy ordering.

On the CPU the Triton kernels run through the interpreter, which executes fp8 tensors (stored as bytes) and
fp8 tl.dot (through fp16, exact for e4m3 operands) but whose fp32 -> fp8 cast does not round to nearest;
the kernels therefore round onto the e4m3 grid in fp32 first (SOFT_CAST, see kernels/triton/fp8.py), and
these tests pin that rounding against torch's float8_e4m3fn conversion. The kernels are compared with the
pure-torch emulation flashtile/reference/fp8_emulation.py (bit-exact quantization, fp32-rounding-close
attention) and with the float64 oracle. Outputs are requested in float32 where compared tightly, as the
emulation's are (tests/test_dtypes_cpu.py checks fp16 / bf16 outputs and the bf16 quantizer).
"""
import math

import pytest
import torch

import flashtile.fp8 as fp8_mod
from flashtile.fp8 import FP8Config, attention_fp8, flash_attn_fp8_func, fp8_config, quantize_fp8
from flashtile.reference import fp8_emulation as E
from flashtile.reference.dense import attention_ref


def _qkv(b, sq, sk, h, hk, d, dtype=torch.float16, outliers=False):
    mk = (lambda s: E.outlier_inputs(s)) if outliers else (lambda s: torch.randn(s))
    return (mk((b, sq, h, d)).to(dtype), mk((b, sk, hk, d)).to(dtype), mk((b, sk, hk, d)).to(dtype))


MODES = [(False, False), (True, False), (False, True), (True, True)]   # (block_quant, incoherent)


@pytest.mark.parametrize("fwht_mma", [False, True])
@pytest.mark.parametrize("block_quant,incoherent", MODES)
def test_quantize_kernel_matches_emulation(seed, block_quant, incoherent, fwht_mma, monkeypatch):
    # fwht_mma: H by the tensor-core product (the GPU default) or by butterflies in the emulation's order.
    # The product sums in another order, so an fp32 result can differ by an ulp: a block's scale by an ulp and,
    # where a value sits on an e4m3 rounding midpoint, its e4m3 value by one step (rare: checked below)
    monkeypatch.setattr(fp8_mod, "FWHT_MMA", fwht_mma)

    def same(got, want, scale_got=None, scale_want=None, rotated=False):
        if not (fwht_mma and rotated):
            assert torch.equal(got, want)
            if scale_got is not None:
                assert torch.equal(scale_got, scale_want)
            return
        if scale_got is not None:
            assert torch.allclose(scale_got, scale_want, rtol=2 ** -22, atol=0)
        step = torch.exp2(torch.floor(torch.log2(torch.maximum(got.abs(), want.abs()).clamp_min(2 ** -6))) - 3)
        assert torch.all((got - want).abs() <= step)
        assert (got != want).float().mean() <= 0.01
    b, sq, sk, h, hk, d = 2, 45, 37, 4, 2, 32
    q, k, v = _qkv(b, sq, sk, h, hk, d, outliers=True)
    cfg = fp8_config(d)
    t = quantize_fp8(q, k, v, block_quant=block_quant, incoherent=incoherent, hadamard_seed=seed % 1000,
                     transpose_v=True)
    signs = E.hadamard_signs(d, seed % 1000)
    qf = E.incoherent_transform(q, signs) if incoherent else q.float()
    kf = E.incoherent_transform(k, signs) if incoherent else k.float()
    for got, got_s, want in ((t.q, t.q_scale, E.quantize(qf, cfg.BLOCK_M, not block_quant)),
                             (t.k, t.k_scale, E.quantize(kf, cfg.BLOCK_N, not block_quant))):
        assert got.dtype == torch.float8_e4m3fn
        same(got.float(), want.x8, got_s, want.descale, rotated=incoherent)
    want_v = E.quantize(v.float(), cfg.BLOCK_N, not block_quant)
    assert t.v.shape == (b, hk, d, 48)                       # V^T, seqlen padded to 16
    same(t.v[..., :sk].float(), want_v.x8.permute(0, 2, 3, 1), t.v_scale, want_v.descale)
    assert torch.all(t.v[..., sk:].float() == 0)
    if not block_quant:
        assert torch.all(t.q_scale == t.q_scale.flatten()[0])
    # dequantized blocks reproduce the (rotated) inputs to e4m3 precision (2^-4 relative)
    deq = t.q.float() * E.Quantized(t.q.float(), t.q_scale, cfg.BLOCK_M).row_descale()
    assert (deq - qf).abs().max() <= qf.abs().max() * 2 ** -4


def test_e4m3_rounding_ties_carries_subnormals(seed):
    # amax = 448 makes the per-tensor scale exactly 1, so the kernel's output is its rounding of x itself
    vals = torch.tensor([448.0, 84.0, 88.0 - 4.0, 125.04, 1.0625, 1.1875, 272.0, 3 * 2 ** -10, 5 * 2 ** -10,
                         2 ** -7 + 2 ** -11, -125.04, -0.3, 0.0, 447.0, 0.001, 300.1])
    x = (torch.randn(1, 32, 1, 16) * 30).clamp(-440, 440)
    x.view(-1)[:16] = vals
    xh = x.to(torch.float16)
    t = quantize_fp8(xh, xh, xh, block_quant=False, incoherent=False, transpose_v=False)
    assert torch.equal(t.q_scale.flatten()[0], torch.tensor(1.0))
    want = xh.float().to(torch.float8_e4m3fn).float()
    assert torch.equal(t.q.float(), want)


def test_fwht_is_the_hadamard_matrix():
    for d in (16, 64, 256):
        x = torch.randn(5, d, dtype=torch.float64)
        assert torch.allclose(E.fwht(x), x @ E.hadamard_matrix(d), atol=1e-10)
    signs = E.hadamard_signs(64, 7)
    q, k = torch.randn(9, 64), torch.randn(11, 64)
    qm, km = E.incoherent_transform(q, signs), E.incoherent_transform(k, signs)
    assert torch.allclose(qm @ km.T, q @ k.T, atol=1e-4)          # M orthogonal: (QM)(KM)^T = QK^T
    assert not torch.equal(E.hadamard_signs(64, 7), E.hadamard_signs(64, 8))
    assert torch.equal(E.hadamard_signs(64, 7), signs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transpose_v", [True, False])
@pytest.mark.parametrize("block_quant,incoherent", [(True, True), (False, False)])
def test_attention_matches_emulation_and_reference(seed, causal, transpose_v, block_quant, incoherent):
    b, sq, sk, h, hk, d = 1, 40, 51, 4, 2, 32    # GQA, ragged tiles, bottom-right causal (sq < sk)
    q, k, v = _qkv(b, sq, sk, h, hk, d)
    out, lse = flash_attn_fp8_func(q, k, v, causal=causal, block_quant=block_quant, incoherent=incoherent,
                                   hadamard_seed=3, return_lse=True, transpose_v=transpose_v,
                                   out_dtype=torch.float32)
    cfg = fp8_config(d, causal)
    eo, el = E.flash_attn_fp8_emulated(q, k, v, causal=causal, block_quant=block_quant, incoherent=incoherent,
                                       hadamard_seed=3, block_m=cfg.BLOCK_M, block_n=cfg.BLOCK_N)
    assert out.shape == (b, sq, h, d) and out.dtype == torch.float32 and lse.shape == (b, h, sq)
    # same quantized operands; only fp32 summation order (and a rare P rounding tie) differ
    assert (out - eo).abs().max() < 2e-2 and (out - eo).pow(2).mean().sqrt() < 1e-3
    assert torch.allclose(lse, el, atol=1e-4, rtol=1e-5)
    ref, ref_lse, _ = attention_ref(q, k, v, causal=causal)
    assert (out.double() - ref).pow(2).mean().sqrt() < 0.03
    assert torch.allclose(lse.double(), ref_lse, atol=0.2)     # score errors of e4m3 Q, K


def test_pointer_and_tma_loads_agree(seed):
    q, k, v = _qkv(1, 33, 47, 2, 1, 32)
    t = quantize_fp8(q, k, v, transpose_v=True)
    a, la = attention_fp8(t, softmax_scale=0.2, causal=True, out_dtype=torch.float32, use_tma=False)
    b, lb = attention_fp8(t, softmax_scale=0.2, causal=True, out_dtype=torch.float32, use_tma=True)
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(la, lb, atol=1e-6)


def test_causal_rows_without_keys_are_zero(seed):
    q, k, v = _qkv(1, 40, 20, 2, 2, 32)        # bottom-right: query i sees keys j <= i - 20
    out, lse = flash_attn_fp8_func(q, k, v, causal=True, return_lse=True, out_dtype=torch.float32)
    assert torch.all(out[:, :20] == 0) and torch.all(lse[:, :, :20] == float("-inf"))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 20:]).all()
    ref = attention_ref(q, k, v, causal=True)[0]
    assert (out.double() - ref).pow(2).mean().sqrt() < 0.03


@pytest.mark.parametrize("per_head", [True, False])
def test_prequantized_fp8_inputs_with_descales(seed, per_head):
    b, s, h, hk, d = 2, 36, 4, 2, 32
    q, k, v = _qkv(b, s, s, h, hk, d, dtype=torch.float32)
    def quant(x):
        if per_head:
            ds = x.abs().amax(dim=(1, 3)) / 448.0                 # (batch, nheads_k)
            x8 = (x / ds[:, None, :, None]).to(torch.float8_e4m3fn)
            return x8, ds, x8.float() * ds[:, None, :, None]
        ds = x.abs().amax().reshape(1) / 448.0
        x8 = (x / ds).to(torch.float8_e4m3fn)
        return x8, ds, x8.float() * ds
    if per_head:   # FA3: q_descale is per (batch, nheads_k); query heads of one group share it
        g = h // hk
        qg = q.view(b, s, hk, g, d)
        dq = qg.abs().amax(dim=(1, 3, 4)) / 448.0
        q8 = (qg / dq[:, None, :, None, None]).to(torch.float8_e4m3fn).view(b, s, h, d)
        qd = (q8.float().view(b, s, hk, g, d) * dq[:, None, :, None, None]).view(b, s, h, d)
    else:
        q8, dq, qd = quant(q)
    k8, dk, kd = quant(k)
    v8, dv, vd = quant(v)
    for tv in (True, False):
        out = flash_attn_fp8_func(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv, transpose_v=tv)
        assert out.dtype == torch.bfloat16
        ref = attention_ref(qd, kd, vd)[0]                      # error left: P in e4m3, bf16 output
        assert (out.double() - ref).pow(2).mean().sqrt() < 0.02
        assert (out.double() - ref).abs().max() < 0.1


def test_backward_raises_naming_fp8(seed):
    q, k, v = _qkv(1, 16, 16, 2, 2, 32)
    q.requires_grad_(True)
    out = flash_attn_fp8_func(q, k, v)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="FP8"):
        out.float().sum().backward()


def test_validation_names_the_argument():
    q, k, v = _qkv(1, 16, 16, 2, 2, 32)
    with pytest.raises(TypeError, match="q.dtype"):
        flash_attn_fp8_func(q.float(), k.float(), v.float())
    with pytest.raises(TypeError, match="k.dtype"):
        flash_attn_fp8_func(q, k.bfloat16(), v)
    with pytest.raises(TypeError, match="k"):
        flash_attn_fp8_func(q, [1], v)
    with pytest.raises(ValueError, match="headdim"):
        q2, k2, v2 = _qkv(1, 16, 16, 2, 2, 40)
        flash_attn_fp8_func(q2, k2, v2, incoherent=True)
    with pytest.raises(ValueError, match="nheads"):
        flash_attn_fp8_func(q, k[:, :, :1].repeat(1, 1, 3, 1), v[:, :, :1].repeat(1, 1, 3, 1))
    with pytest.raises(ValueError, match="descale"):
        flash_attn_fp8_func(q, k, v, q_descale=torch.ones(1))
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_fp8_func(q, k, v, softmax_scale=-1.0)
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    with pytest.raises(ValueError, match="k_descale.shape"):
        flash_attn_fp8_func(q8, k8, v8, k_descale=torch.ones(3, 3))
    with pytest.raises(TypeError, match="v_descale"):
        flash_attn_fp8_func(q8, k8, v8, v_descale=0.5)
    with pytest.raises(TypeError, match="hadamard_seed"):
        quantize_fp8(q, k, v, hadamard_seed=1.5)
    # headdim 40 without incoherent processing is fine (padded tiles)
    q2, k2, v2 = _qkv(1, 16, 16, 2, 2, 40)
    out = flash_attn_fp8_func(q2, k2, v2, incoherent=False, out_dtype=torch.float32)
    assert (out.double() - attention_ref(q2, k2, v2)[0]).pow(2).mean().sqrt() < 0.03


def test_fa3_table3_accuracy_ordering_emulated():
    """FA3 Table 3 at a CPU size, with the pure-torch emulation (the kernel matches it above): with
    N(0,1) + N(0,100)·Bernoulli(0.001) inputs, incoherent processing cuts the per-tensor FP8 baseline's RMSE
    (FA3: 2.6x at b4 h16 n4096 d128; here ~1.7x at n1024, growing with n), block quantization alone
    does not hurt, and both together are as good as incoherent processing."""
    g = torch.Generator().manual_seed(1234)
    q, k, v = (E.outlier_inputs((1, 1024, 4, 128), g).to(torch.bfloat16) for _ in range(3))
    ref = attention_ref(q, k, v)[0]
    rmse = {}
    for bq, inc in MODES:
        out, _ = E.flash_attn_fp8_emulated(q, k, v, block_quant=bq, incoherent=inc)
        rmse[(bq, inc)] = (out.double() - ref).pow(2).mean().sqrt().item()
    base, block, inco, both = rmse[(False, False)], rmse[(True, False)], rmse[(False, True)], rmse[(True, True)]
    assert both * 1.4 < base, rmse
    assert inco * 1.4 < base, rmse
    assert block <= base * 1.02, rmse
    assert both <= inco * 1.1, rmse


def test_kernel_accuracy_ordering_small(seed):
    """The same ordering through the Triton kernels (interpreter) at a tiny size, in float32 output. At this size
    one draw holds only ~65 outliers per tensor, and a single draw inverts the ordering about 1 time in 24
    (measured over seeds 0-23: MSE ratio 0.39-1.04); the RMSE is therefore pooled over 4 independent draws
    (pooled ratio 0.46-0.82 over 12 groups), which keeps the claim and removes the flakiness."""
    g = torch.Generator().manual_seed(seed)
    sq_err = {(False, False): 0.0, (True, True): 0.0}
    for _ in range(4):
        q, k, v = (E.outlier_inputs((1, 128, 2, 64), g, p=0.004).to(torch.float16) for _ in range(3))
        ref = attention_ref(q, k, v)[0]
        for bq, inc in sq_err:
            out = flash_attn_fp8_func(q, k, v, block_quant=bq, incoherent=inc, out_dtype=torch.float32)
            sq_err[(bq, inc)] += (out.double() - ref).pow(2).mean().item()
    r = {key: (val / 4) ** 0.5 for key, val in sq_err.items()}
    assert r[(True, True)] < r[(False, False)], r


@pytest.mark.parametrize("fwht_mma", [False, True])
@pytest.mark.parametrize("block_quant,incoherent", MODES)
def test_quantizer_groups_of_blocks_write_what_single_blocks_do(seed, block_quant, incoherent, fwht_mma,
                                                                monkeypatch):
    """quant_fp8_kernel with GROUP row blocks per program (H built once per program; the last program of a head
    gets fewer blocks) writes the same bytes and descales as one block per program, for Q, K and V^T in the
    Gluon key order, block and per-tensor scales (the per-tensor pass's amaxes are grouped the same way)."""
    monkeypatch.setattr(fp8_mod, "FWHT_MMA", fwht_mma)
    q, k, v = _qkv(2, 300, 224, 3, 3, 32, outliers=True)      # 5 Q blocks of 64 (last ragged), 7 K / V of 32

    def run(group):
        monkeypatch.setattr(fp8_mod, "quant_group", lambda nblk, heads, device: min(group, nblk))
        return quantize_fp8(q, k, v, block_quant=block_quant, incoherent=incoherent, hadamard_seed=seed % 1000,
                            block_m=64, block_n=32, v_key_perm=True)
    one, grouped = run(1), run(3)
    for name in ("q", "k", "v", "q_scale", "k_scale", "v_scale"):
        a, b = getattr(one, name), getattr(grouped, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name


def test_quantizer_launch_rules(monkeypatch):
    """Blocks per quantizer program: QUANT_GROUP, halved while a head would get two or more groups' worth less
    than its blocks or the launch fewer than QUANT_MIN_PROGRAMS_PER_SM programs per SM. Pipeline depth: 3 where
    three input tiles and H fit QUANT_SMEM, else 2, else 1 (d256 K blocks: a 64 KB tile beside a 128 KB H)."""
    monkeypatch.setattr(fp8_mod, "QUANT_GROUP", 8)
    monkeypatch.setattr(fp8_mod, "QUANT_MIN_PROGRAMS_PER_SM", 0.5)
    cpu = torch.device("cpu")                                   # multiprocessors() reads 8 SMs: >= 4 programs
    assert fp8_mod.quant_group(256, 512, cpu) == 8              # many blocks: the cap
    assert fp8_mod.quant_group(64, 1, cpu) == 8                 # 8 programs of 8
    assert fp8_mod.quant_group(16, 1, cpu) == 4                 # 4 programs of 4, not 2 of 8
    assert fp8_mod.quant_group(3, 512, cpu) == 4                # one program covers a head's 3 blocks
    assert fp8_mod.quant_group(2, 1, cpu) == 1                  # too few blocks to group
    assert [fp8_mod.quant_stages(blk, d, 2, True) for blk, d in ((128, 128), (64, 256), (128, 256))] == [3, 2, 1]
    assert fp8_mod.quant_stages(128, 256, 2, False) == 3
    monkeypatch.setattr(fp8_mod, "QUANT_STAGES", 1)
    assert fp8_mod.quant_stages(64, 64, 2, True) == 1


def test_quantizer_writes_v_in_the_gluon_key_order(seed):
    """quantize_fp8(v_key_perm=True) (the Gluon kernel's V^T, kernels/triton/fp8.key_perm) stores the same bytes
    as the torch permutation the pre-quantized path applies (fp8.gluon_key_order), a permutation of the keys
    within each 32: the P V product is unchanged when P's columns move the same way."""
    q, k, v = _qkv(2, 64, 96, 2, 2, 32)
    plain = quantize_fp8(q, k, v, v_key_perm=False, block_m=32, block_n=32)
    perm = quantize_fp8(q, k, v, v_key_perm=True, block_m=32, block_n=32)
    assert perm.v_key_perm and not plain.v_key_perm
    assert torch.equal(fp8_mod.gluon_key_order(plain.v.view(torch.uint8)), perm.v.view(torch.uint8))
    assert torch.equal(plain.v_scale, perm.v_scale)
    idx = fp8_mod.gluon_key_order(torch.arange(96))
    assert sorted(idx.tolist()) == list(range(96)) and idx[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]
    with pytest.raises(ValueError, match="Gluon kernel's key order"):
        attention_fp8(perm, softmax_scale=0.2, config=FP8Config(32, 32, 4, 1))
    with pytest.raises(ValueError, match="v_key_perm"):
        quantize_fp8(q, k, v, v_key_perm=True, transpose_v=False)


@pytest.mark.parametrize("prequantized", [False, True])
def test_gluon_dispatch_gets_its_blocks_key_order_and_descales(prequantized, seed, monkeypatch):
    """Where fa3.supports_fp8 says yes (a Hopper GPU; faked here), flash_attn_fp8_func quantizes with the Gluon
    kernel's tiles, V^T in its key order, and hands it one descale per (batch, head, block): pre-quantized
    inputs' per-(batch, nheads_k) descales expanded, q's through h // group. The kernel itself runs in
    tests/gpu/test_fp8_gluon_gpu.py."""
    b, s, h, hk, d = 1, 256, 4, 2, 128
    seen = {}

    def fake_kernel(q8, k8, vt8, qs, ks, vs, out, lse, scale, causal):
        seen.update(q8=q8, k8=k8, vt8=vt8, qs=qs, ks=ks, vs=vs)
        out.zero_()
        lse.zero_()
    monkeypatch.setattr(fp8_mod._fa3, "supports_fp8", lambda *a: True)
    monkeypatch.setattr(fp8_mod._fa3, "fwd_fp8", fake_kernel)
    block_m, block_n = fp8_mod._fa3.fp8_block_shape(d)
    q, k, v = _qkv(b, s, s, h, hk, d)
    if prequantized:
        dq, dk, dv = (torch.rand(b, hk) + 0.5 for _ in range(3))
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        flash_attn_fp8_func(q8, k8, v8, q_descale=dq, k_descale=dk, v_descale=dv)
        vt_plain = v8.permute(0, 2, 3, 1).contiguous().view(torch.uint8)
        assert torch.equal(seen["qs"], dq.repeat_interleave(h // hk, dim=1)[..., None].expand(b, h, s // block_m))
        assert torch.equal(seen["ks"], dk[..., None].expand(b, hk, s // block_n))
        assert torch.equal(seen["vs"], dv[..., None].expand(b, hk, s // block_n))
    else:
        flash_attn_fp8_func(q, k, v, incoherent=False)
        vt_plain = quantize_fp8(q, k, v, incoherent=False, v_key_perm=False, block_m=block_m,
                                block_n=block_n).v.view(torch.uint8)
        assert seen["qs"].shape == (b, h, s // block_m) and seen["ks"].shape == (b, hk, s // block_n)
    assert all(seen[x].is_contiguous() for x in ("q8", "k8", "vt8", "qs", "ks", "vs"))
    assert torch.equal(seen["vt8"].view(torch.uint8), fp8_mod.gluon_key_order(vt_plain))
