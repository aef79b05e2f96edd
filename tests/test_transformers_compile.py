"""attn_implementation="flashtile" under torch.compile and with a static cache, checked against "sdpa".

Tiny random Llama models in float32 on the CPU (Triton interpreter), so flashtile and SDPA agree to float32
rounding. torch.compile runs with backend="aot_eager": Dynamo traces the model (where graph breaks happen) and
AOTAutograd traces the forward and backward graphs through the custom ops' fake implementations, without
generating code. Covered: training forward + backward at batch 1 and 2, dense and padded, and a batch-1 row packing
three sequences, all without a graph break; generate() with cache_implementation="static", eager and with
transformers' compiled decoding step, giving SDPA's tokens, unpadding the prefill and no decode step; the dense
key-masked path that decode steps and traced calls take, against the unpadded varlen path.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile  # noqa: E402,F401  (sets TRITON_INTERPRET on CPU-only machines before the kernels load)
from torch._dynamo.utils import counters  # noqa: E402

from flashtile.integrations import transformers as ft_hf  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQ = 16
RTOL = 1e-4
BACKEND = "aot_eager"


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert ft_hf.register() == "flashtile"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _config():
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def _pair(seed: int):
    """The same random weights under flashtile and under SDPA."""
    torch.manual_seed(seed)
    ours = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation="flashtile")
    ref = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    return ours.to(DEVICE), ref.to(DEVICE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _logits_and_grads(model, ids, mask, position_ids, w, compiled=False):
    """Logits at real tokens and every parameter gradient of a token-weighted loss over them; compiled: through
    torch.compile(model)."""
    model.zero_grad(set_to_none=True)
    fn = torch.compile(model, backend=BACKEND) if compiled else model
    logits = fn(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    (logits[real] * w[real]).sum().backward()
    return logits[real].detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("batch,padded", [(1, False), (1, True), (2, False), (2, True)])
def test_compiled_training_step_has_no_graph_break(batch, padded, seed, monkeypatch):
    """Forward + backward of the compiled model: no graph break (SDPA has none either), logits and every parameter
    gradient equal to eager SDPA's. Traced, padded batches and a batch-1 row without a mask take the row ops (the
    padded ones the varlen kernel over each row's run of tokens)."""
    ours, ref = _pair(seed)
    ours.train()
    ref.train()
    ids = torch.randint(0, 128, (batch, SEQ), device=DEVICE)
    mask = None
    if padded:
        mask = torch.ones(batch, SEQ, dtype=torch.long, device=DEVICE)
        mask[-1, SEQ - 5:] = 0       # right padding in the last row
        if batch > 1:
            mask[0, :3] = 0          # left padding in the first
    w = torch.randn(batch, SEQ, 128, device=DEVICE)
    runs = []
    real_runs = ft_hf._mask_runs
    monkeypatch.setattr(ft_hf, "_mask_runs", lambda m: runs.append(real_runs(m)) or runs[-1])
    lo, go = _logits_and_grads(ours, ids, mask, None, w, compiled=True)
    assert _graph_breaks() == 0, dict(counters["graph_break"])
    assert all(r is not None for r in runs) and bool(runs) == padded   # (padded: the varlen route, its runs read)
    lr, gr = _logits_and_grads(ref, ids, mask, None, w)
    assert _rel(lo, lr) < RTOL
    for name in gr:
        assert _rel(go[name], gr[name]) < RTOL, name


def test_mask_runs_cover_each_row_with_three_sequences():
    """A padded batch's runs (read when a compiled graph runs): per row the padding before its tokens, the tokens,
    the padding after them, over the flattened b * s tokens; None where a row's tokens are not one run."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    assert ft_hf._mask_runs(mask).tolist() == [0, 2, 5, 6, 6, 12, 12, 12, 12, 18, 18, 20, 24]
    assert ft_hf._mask_runs(mask.bool()).dtype == torch.int32
    holed = mask.clone()
    holed[1, 3] = 0
    assert ft_hf._mask_runs(holed) is None


@pytest.mark.parametrize("trial", range(40))
def test_mask_runs_against_a_per_row_reading(trial, seed):
    """_mask_runs on random masks (contiguous runs anywhere, empty and full rows, and rows with holes) against a
    plain per-row reading: sequences (before, tokens, after) in order over the flattened b * s tokens, the tokens'
    sequence exactly the row's ones; None exactly when some row's ones are not one run."""
    g = torch.Generator().manual_seed(seed * 1000 + trial)
    b, s = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    mask = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        start = int(torch.randint(0, s + 1, (1,), generator=g))
        mask[r, start:start + int(torch.randint(0, s + 1, (1,), generator=g))] = 1
    if trial % 3 == 0:   # holes: random bits
        mask = (torch.rand(b, s, generator=g) < 0.6).long()
    ones = [mask[r].nonzero().flatten().tolist() for r in range(b)]
    runs = all(not o or o == list(range(o[0], o[-1] + 1)) for o in ones)
    cu = ft_hf._mask_runs(mask)
    assert (cu is not None) == runs, (mask, cu)
    if cu is None:
        return
    cu = cu.tolist()
    assert len(cu) == 3 * b + 1 and cu[0] == 0 and cu[-1] == b * s and cu == sorted(cu)
    for r, o in enumerate(ones):
        before, tokens, after = cu[3 * r], cu[3 * r + 1], cu[3 * r + 2]
        assert before == r * s and cu[3 * r + 3] == (r + 1) * s
        assert list(range(tokens, after)) == [r * s + i for i in o]


@pytest.mark.parametrize("fwd_varlen,bwd_varlen", [(False, True), (True, False), (False, False)])
def test_padded_row_ops_take_either_route_in_each_direction(fwd_varlen, bwd_varlen, monkeypatch, seed):
    """The row ops' forward and backward may take different routes (one of them inside a CUDA-graph capture: key
    mask; the other not: varlen). With padding rows whose q . k is huge (their scores against their own keys overflow
    exp under the other route's lse), the gradients stay finite and equal to the varlen-only run's."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    q[:, 5:], k[:, 5:] = 30.0, 30.0
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    opts = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                deterministic=False)
    real = ft_hf._mask_runs

    def run(fwd, bwd):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        monkeypatch.setattr(ft_hf, "_SEEN", {})
        monkeypatch.setattr(ft_hf, "_mask_runs", real if fwd else (lambda m: None))
        out = ft_hf._traced_rows(*leaves, mask, ft_hf.PADDED, opts).masked_fill(~mask.bool()[:, :, None, None], 0)
        monkeypatch.setattr(ft_hf, "_SEEN", {})
        monkeypatch.setattr(ft_hf, "_mask_runs", real if bwd else (lambda m: None))
        out.backward(torch.ones_like(out))
        return [out] + [t.grad for t in leaves]

    expected = run(True, True)
    for got, want in zip(run(fwd_varlen, bwd_varlen), expected):
        assert torch.isfinite(got).all()
        assert _rel(got, want) < RTOL


def test_padded_row_ops_refuse_dropout_in_a_backward_inside_a_capture(monkeypatch, seed):
    """With dropout, a backward inside a CUDA-graph capture (stood in for by values_readable) whose forward ran
    outside one would replay a dropout mask drawn for the other route's layout: it raises, naming dropout_p."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 8, 2, 16, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
    opts = dict(dropout_p=0.25, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                deterministic=False)
    out = ft_hf._traced_rows(q, k, v, mask, ft_hf.PADDED, opts)
    monkeypatch.setattr(ft_hf, "values_readable", lambda t: False)
    with pytest.raises(ValueError, match="dropout_p"):
        out.sum().backward()


def test_row_ops_inside_a_capture(monkeypatch, seed):
    """Inside a CUDA-graph capture (no value may be read; stood in for by values_readable): a padded batch's ops take
    the key mask, equal to the varlen route's output; a batch-1 row's positions cannot be read, so whether it packs
    sequences cannot be known: a clear error naming position_ids rather than the CUDA error of a read."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 8, 2, 16) for _ in range(3))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
    opts = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                deterministic=False)
    zero_padding = ~mask.bool()[:, :, None, None]
    expected = ft_hf._traced_rows(q, k, v, mask, ft_hf.PADDED, opts).masked_fill(zero_padding, 0)
    monkeypatch.setattr(ft_hf, "_SEEN", {})
    monkeypatch.setattr(ft_hf, "values_readable", lambda t: False)
    got = ft_hf._traced_rows(q, k, v, mask, ft_hf.PADDED, opts).masked_fill(zero_padding, 0)
    assert _rel(got, expected) < RTOL
    with pytest.raises(ValueError, match="position_ids"):
        ft_hf._traced_rows(q[:1], k[:1], v[:1], torch.arange(8)[None], ft_hf.PACKED, opts)


def test_compiled_padded_batch_with_holes_takes_the_key_mask(seed, monkeypatch):
    """A padding mask whose tokens are not one run per row, compiled: the ops run the key-masked dense kernel (the
    runs of the other test's masks take varlen): logits and gradients equal to SDPA's, no graph break."""
    runs = []
    real_runs = ft_hf._mask_runs
    monkeypatch.setattr(ft_hf, "_mask_runs", lambda m: runs.append(real_runs(m)) or runs[-1])
    ours, ref = _pair(seed)
    ours.train()
    ref.train()
    ids = torch.randint(0, 128, (2, SEQ), device=DEVICE)
    mask = torch.ones(2, SEQ, dtype=torch.long, device=DEVICE)
    mask[0, 4] = 0
    mask[1, SEQ - 3:] = 0
    w = torch.randn(2, SEQ, 128, device=DEVICE)
    lo, go = _logits_and_grads(ours, ids, mask, None, w, compiled=True)
    assert _graph_breaks() == 0, dict(counters["graph_break"])
    assert runs and all(r is None for r in runs)
    lr, gr = _logits_and_grads(ref, ids, mask, None, w)
    assert _rel(lo, lr) < RTOL
    for name in gr:
        assert _rel(go[name], gr[name]) < RTOL, name


def test_compiled_packed_row_keeps_sequences_apart(seed):
    """Batch 1 packing sequences of 7, 4 and 5 tokens (position_ids restart), compiled: no graph break (the positions
    are read when the graph runs, by flashtile::row_fwd / row_bwd), and logits and gradients equal those of SDPA
    run on each sequence alone."""
    ours, ref = _pair(seed)
    lens = (7, 4, 5)
    ids = torch.randint(0, 128, (1, sum(lens)), device=DEVICE)
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0).to(DEVICE)
    w = torch.randn(1, sum(lens), 128, device=DEVICE)
    logits, grads = _logits_and_grads(ours, ids, None, pos, w, compiled=True)
    assert _graph_breaks() == 0, dict(counters["graph_break"])
    pieces, start = [], 0
    for n in lens:
        piece = ref(ids[:, start:start + n]).logits
        (piece * w[:, start:start + n]).sum().backward()   # gradients accumulate over the pieces
        pieces.append(piece.detach()[0])
        start += n
    assert _rel(logits, torch.cat(pieces)) < RTOL
    for name, p in ref.named_parameters():
        assert _rel(grads[name], p.grad) < RTOL, name


def _spy(monkeypatch, calls):
    """Record (name, seqlen_q) of every eager call of the integration's unpadded and key-masked paths and of the
    varlen and unpad functions it calls. (Calls traced by torch.compile are not recorded: a recorder inside a traced
    function would make Dynamo guard on it.)"""
    def wrap(name, fn, seqlen_q):
        def spy(*args, **kwargs):
            if not torch.compiler.is_compiling():
                calls.append((name, seqlen_q(args)))
            return fn(*args, **kwargs)
        return spy
    for name, seqlen_q in (("_unpadded", lambda a: a[0].shape[1]), ("_key_masked", lambda a: a[0].shape[1]),
                           ("_full_mask", lambda a: a[0].shape[1]), ("unpad_input", lambda a: a[0].shape[1]),
                           ("flash_attn_varlen_func", lambda a: None), ("flash_attn_func", lambda a: a[0].shape[1])):
        monkeypatch.setattr(ft_hf, name, wrap(name, getattr(ft_hf, name), seqlen_q))


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_static_cache_generate_matches_sdpa(compiled, padded, monkeypatch, seed):
    """generate(cache_implementation="static"): SDPA's tokens and scores. The prefill (eager, 7 queries per row)
    unpads the tokens of a left-padded batch, and runs the dense kernel over the prompt's slots where nothing is
    padded; the decode steps (one query per row) run the dense kernel under transformers' 4-D mask over the
    cache's slots, never unpadding: eagerly, or inside transformers' compiled decoding step without a graph break
    and with one input shape for every step (no recompilation)."""
    ours, ref = _pair(seed)
    ours.eval()
    ref.eval()
    ids = torch.randint(1, 128, (2, 7), device=DEVICE)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    new = 4
    # (eos_token_id None: every step runs, also where a greedy token of the random weights is the EOS token)
    kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
              output_scores=True, return_dict_in_generate=True, cache_implementation="static")
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    built = []   # the shape of every mask the builder returns (the compiled step's input)

    def builder(**kwargs):
        mask = ft_hf.padding_mask(**kwargs)
        built.append(None if mask is None else tuple(mask.shape))
        return mask

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "flashtile", builder)
    with torch.no_grad():
        expected = ref.generate(ids, disable_compile=True, **kw)
        calls = []
        _spy(monkeypatch, calls)
        if compiled:
            cc = transformers.CompileConfig(backend=BACKEND, mode=None)
            cc._compile_all_devices = True   # transformers compiles on accelerators only; the CPU run forces it
            got = ours.generate(ids, compile_config=cc, **kw)
        else:
            got = ours.generate(ids, disable_compile=True, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores):
        assert _rel(a, b) < RTOL
    layers = ours.config.num_hidden_layers
    # every decode step, the last (whose 2-D mask covers every slot) included, gets the 4-D mask
    decode = [] if compiled else [("_full_mask", 1), ("flash_attn_func", 1)] * (layers * (new - 1))
    prefill = ("flash_attn_varlen_func", None) if padded else ("flash_attn_func", 7)
    assert calls == [("_unpadded", 7), prefill] * layers + decode
    # the prefill's 2-D mask, then one mask shape for every decode step: the compiled step records one CUDA graph
    steps = [shape for shape in built if len(shape) == 4]
    assert [shape for shape in built if len(shape) != 4] and all(shape == (2, 7) for shape in built[:-len(steps)])
    assert len(steps) == new - 1 and len(set(steps)) == 1 and steps[0][:3] == (2, 1, 1), built
    if compiled:
        assert _graph_breaks() == 0, dict(counters["graph_break"])


@pytest.mark.parametrize("q_len,empty_slots,window", [(1, 0, None), (1, 3, None), (1, 3, 4), (3, 0, 4), (3, 3, None),
                                                      (3, 3, 4)])
def test_key_masked_equals_unpadded(q_len, empty_slots, window, seed):
    """The dense key-masked path against the unpadded varlen path on padded rows whose queries are the mask's last
    positions, with keys past the mask (a static cache's empty slots, filled with garbage here) and a sliding
    window: equal outputs, zeros for padding queries."""
    g = torch.Generator().manual_seed(seed)
    b, h, hk, d, m = 3, 4, 2, 16, 12
    kv = m + empty_slots
    q = torch.randn(b, q_len, h, d, generator=g).to(DEVICE)
    k = torch.randn(b, kv, hk, d, generator=g).to(DEVICE)
    v = torch.randn(b, kv, hk, d, generator=g).to(DEVICE)
    mask = torch.ones(b, m, dtype=torch.bool)
    mask[0, :5] = False                  # left padding
    mask[1, 4:6] = False                 # a hole
    mask[2, m - 1] = False               # the last query is padding
    mask = mask.to(DEVICE)
    opts = dict(dropout_p=0.0, softmax_scale=None, causal=True, window_size=ft_hf._window(window, True), softcap=0.0,
                deterministic=False)
    got = ft_hf._key_masked(q, k, v, mask, opts)
    want = ft_hf._unpadded(q, k, v, mask, opts)
    assert torch.equal(got[2, -1], torch.zeros_like(got[2, -1]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
