"""Autotuning cache (flashtile/kernels/triton/tuning.py): key bucketing, the JSON file's round trip, corrupt files,
tune_key's choice, the interpreter and FLASHTILE_AUTOTUNE gates, and launch.py's hook. CPU only: the device
fingerprint is faked and bench_fn returns made-up milliseconds, so no kernel runs."""
import json
import os

import pytest
import torch

from flashtile.kernels.triton import configs, launch, tuning
from flashtile.kernels.triton.configs import Config

FAKE_GPU = "NVIDIA H200 (fake)-triton3.6.0"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, a fake GPU, the interpreter off (lookup answers None under it) and no tuning flag."""
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FLASHTILE_AUTOTUNE", raising=False)
    monkeypatch.setattr(tuning, "device_fingerprint", lambda: FAKE_GPU)
    tuning._reset()
    yield tmp_path
    tuning._reset()
    configs.CONFIG_OVERRIDE.clear()


def _fake_bench(ms_by_config, failing=()):
    """bench_fn: ms from the table, RuntimeError for `failing`; records the configs it was called with."""
    calls = []

    def bench(cfg):
        calls.append(cfg)
        if cfg in failing:
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
        return ms_by_config[cfg]
    bench.calls = calls
    return bench


D64_FWD = tuning.FWD[64]
# the 3rd candidate is fastest, the 1st would be faster still but does not compile
D64_MS = {c: 2.0 + i for i, c in enumerate(D64_FWD)}
D64_MS[D64_FWD[2]] = 0.5
D64_MS[D64_FWD[0]] = 0.1


def test_key_buckets_head_dim_and_seqlen():
    assert tuning.make_key("fwd", 80, torch.bfloat16, True, 3000) == tuning.Key("fwd", 128, "bfloat16", True, 4096)
    assert [tuning.seqlen_bucket(n) for n in (1, 1000, 1024, 1025, 5000, 16384, 16385, 10 ** 6)] == \
        [1024, 1024, 1024, 2048, 8192, 16384, 16384, 16384]
    assert [tuning.block_d(d) for d in (8, 16, 40, 64, 65, 128, 129, 256)] == [16, 16, 64, 64, 128, 128, 256, 256]
    assert str(tuning.make_key("bwd", 64, torch.float16, False, 8192)) == "bwd/d64/float16/full/n8192"
    # max(seqlen_q, seqlen_k) is the caller's; keys of the same bucket are one key
    assert tuning.make_key("fwd", 128, torch.float16, False, 5000) == tuning.make_key("fwd", 120, "float16", 0, 8000)
    with pytest.raises(ValueError, match="pass_"):
        tuning.make_key("forward", 64, torch.float16, False, 1024)


def test_candidates_are_the_sweep_lists_plus_extra():
    assert tuning.candidates("fwd", 32) == tuning.FWD[64]
    assert tuning.candidates("bwd", 96) == tuning.BWD[128]
    assert tuning.candidates("fwd", 200) == tuning.FWD[256]
    assert all(isinstance(c, Config) for lst in (*tuning.FWD.values(), *tuning.BWD.values()) for c in lst)
    extra = Config(16, 16, 2, 1)
    assert tuning.candidates("fwd", 64, [extra, tuning.FWD[64][0]]) == tuning.FWD[64] + [extra]  # no duplicate
    # configs.py's hand-picked table is among the candidates (it holds the sweep's winners)
    assert Config(128, 64, 4, 3) in tuning.FWD[64] and Config(64, 128, 8, 2) in tuning.BWD[128]


def test_cache_path_names_the_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    assert tuning.cache_path("NVIDIA H200 NVL-triton3.6.0") == str(tmp_path / "tune-NVIDIA_H200_NVL-triton3.6.0.json")
    assert tuning.cache_path("a/b\\c:d") == str(tmp_path / "tune-a_b_c_d.json")
    monkeypatch.delenv("FLASHTILE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_dir() == str(tmp_path / "home" / ".cache" / "flashtile")


def test_tune_key_picks_fastest_skips_failing_and_persists(cache):
    bench = _fake_bench(D64_MS, failing=[D64_FWD[0]])
    best = tuning.tune_key("fwd", 64, torch.float16, True, 2000, bench)
    assert best == D64_FWD[2]
    assert bench.calls == D64_FWD  # every candidate timed once, in order
    data = json.loads((cache / "tune-NVIDIA_H200_fake_-triton3.6.0.json").read_text())
    assert data["version"] == tuning.CACHE_VERSION and data["fingerprint"] == FAKE_GPU
    entry = data["entries"]["fwd/d64/float16/causal/n2048"]
    assert {k: entry["config"][k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")} == \
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    assert Config(**entry["config"]) == D64_FWD[2]  # every field of Config stored
    assert entry["ms"] == 0.5
    assert list(entry["failed"]) == ["128x64/w4/s3"] and "shared memory" in entry["failed"]["128x64/w4/s3"]
    assert "128x64/w4/s3" not in entry["timings"] and len(entry["timings"]) == len(D64_FWD) - 1
    assert [f for f in os.listdir(cache) if not f.startswith("tune-")] == []  # no temp file left behind
    assert tuning.lookup("fwd", 64, torch.float16, True, 2000) == D64_FWD[2]


def test_nan_or_nonpositive_time_is_not_a_winner(cache):
    ms = dict(D64_MS)
    ms[D64_FWD[0]], ms[D64_FWD[2]] = float("nan"), 0.0
    ms[D64_FWD[5]] = 1.5
    assert tuning.tune_key("fwd", 64, torch.float16, False, 1024, _fake_bench(ms)) == D64_FWD[5]
    entry = tuning._entries(FAKE_GPU)["fwd/d64/float16/full/n1024"]
    assert set(entry["failed"]) == {"128x64/w4/s3", "128x128/w8/s3"}


def test_second_process_reads_persisted_winner(cache):
    tuning.tune_key("bwd", 128, torch.bfloat16, False, 8192, _fake_bench({c: 9.0 - i for i, c in
                                                                         enumerate(tuning.BWD[128])}))
    tuning._reset()  # a new process: nothing in memory
    assert tuning._loaded == {}
    assert tuning.lookup("bwd", 128, torch.bfloat16, False, 6000) == tuning.BWD[128][-1]  # same bucket n8192
    assert tuning.lookup("bwd", 128, torch.bfloat16, True, 8192) is None   # other causal
    assert tuning.lookup("bwd", 128, torch.bfloat16, False, 16384) is None  # other bucket
    assert tuning.lookup("fwd", 128, torch.bfloat16, False, 8192) is None   # other pass
    # loaded once per process: a file changed behind its back is not re-read
    path = tuning.cache_path(FAKE_GPU)
    os.remove(path)
    assert tuning.lookup("bwd", 128, torch.bfloat16, False, 8192) == tuning.BWD[128][-1]


def test_store_merges_keys_written_by_another_process(cache):
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) is None  # loads the (absent) file
    other = dict(version=tuning.CACHE_VERSION, fingerprint=FAKE_GPU, entries={
        "fwd/d256/float16/full/n1024": dict(config=dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
                                            ms=1.0, timings={}, failed={})})
    with open(tuning.cache_path(FAKE_GPU), "w") as f:
        json.dump(other, f)
    tuning.tune_key("fwd", 64, torch.float16, False, 1024, _fake_bench(D64_MS))
    entries = json.loads(open(tuning.cache_path(FAKE_GPU)).read())["entries"]
    assert set(entries) == {"fwd/d256/float16/full/n1024", "fwd/d64/float16/full/n1024"}
    assert tuning.lookup("fwd", 256, torch.float16, False, 1024) == Config(64, 32, 4, 3)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"version": 99, "entries": {}}', '{"version": 1}'])
def test_corrupt_cache_file_is_ignored_with_a_warning(cache, content):
    path = tuning.cache_path(FAKE_GPU)
    with open(path, "w") as f:
        f.write(content)
    with pytest.warns(RuntimeWarning, match="ignoring tuning cache"):
        assert tuning.lookup("fwd", 64, torch.float16, False, 1024) is None
    # tuning afterwards replaces the bad file with a good one
    assert tuning.tune_key("fwd", 64, torch.float16, False, 1024, _fake_bench(D64_MS)) == D64_FWD[0]
    tuning._reset()
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) == D64_FWD[0]


def test_bad_entry_is_dropped_good_entries_kept(cache):
    entries = {"fwd/d64/float16/full/n1024": dict(config=dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
               "fwd/d64/float16/causal/n1024": dict(config=dict(BLOCK_M=64, TILE=3)),
               "bwd/d64/float16/full/n1024": "nonsense"}
    with open(tuning.cache_path(FAKE_GPU), "w") as f:
        json.dump(dict(version=tuning.CACHE_VERSION, entries=entries), f)
    with pytest.warns(RuntimeWarning, match="ignoring tuning cache entry"):
        assert tuning.lookup("fwd", 64, torch.float16, False, 1024) == Config(64, 64, 4, 2)
    assert tuning.lookup("fwd", 64, torch.float16, True, 1024) is None
    assert tuning.lookup("bwd", 64, torch.float16, False, 1024) is None


def test_every_candidate_failing_caches_the_failure(cache):
    bench = _fake_bench({}, failing=D64_FWD)
    with pytest.warns(RuntimeWarning, match="every candidate failed"):
        assert tuning.tune_key("fwd", 64, torch.float16, False, 1024, bench) is None
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) is None
    # tried once: a later launch does not tune the key again
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHTILE_AUTOTUNE", "1")
        assert not tuning.needs_tuning("fwd", 64, torch.float16, False, 1024, torch.device("cuda"))
        assert tuning.needs_tuning("fwd", 64, torch.float16, True, 1024, torch.device("cuda"))


def test_unwritable_cache_dir_warns_and_keeps_winner_in_memory(cache, monkeypatch):
    blocker = cache / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(blocker / "sub"))
    with pytest.warns(RuntimeWarning, match="could not write tuning cache"):
        assert tuning.tune_key("fwd", 64, torch.float16, False, 1024, _fake_bench(D64_MS)) == D64_FWD[0]
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) == D64_FWD[0]


def test_interpreter_never_tunes_and_lookup_returns_none(cache, monkeypatch):
    tuning.tune_key("fwd", 64, torch.float16, False, 1024, _fake_bench(D64_MS))
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) == D64_FWD[0]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) is None
    bench = _fake_bench(D64_MS)
    assert tuning.tune_key("fwd", 64, torch.float16, True, 1024, bench) is None
    assert bench.calls == []
    assert not tuning.autotune_enabled("fwd")
    assert not tuning.needs_tuning("fwd", 64, torch.float16, True, 1024, torch.device("cuda"))
    assert launch.fwd_config(64, torch.float16, False, seqlen=1024) == Config(32, 16, 4, 1)  # interpreter tiles


def test_without_cuda_lookup_and_tune_key_do_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(tuning, "device_fingerprint", lambda: None)
    tuning._reset()
    bench = _fake_bench(D64_MS)
    assert tuning.tune_key("fwd", 64, torch.float16, False, 1024, bench) is None and bench.calls == []
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) is None
    assert os.listdir(tmp_path) == []


def test_autotune_env_gates(cache, monkeypatch):
    cuda = torch.device("cuda")  # a device object only: nothing is allocated
    assert not tuning.needs_tuning("fwd", 64, torch.float16, False, 1024, cuda)  # default: off
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    assert tuning.needs_tuning("fwd", 64, torch.float16, False, 1024, cuda)
    assert not tuning.needs_tuning("fwd", 64, torch.float16, False, 1024, torch.device("cpu"))
    configs.CONFIG_OVERRIDE["fwd"] = Config(64, 64, 4, 2)  # a pinned config (and autotune's own re-launches)
    assert not tuning.needs_tuning("fwd", 64, torch.float16, False, 1024, cuda)
    assert tuning.needs_tuning("bwd", 64, torch.float16, False, 1024, cuda)
    configs.CONFIG_OVERRIDE.clear()
    tuning.tune_key("fwd", 64, torch.float16, False, 1024, _fake_bench(D64_MS))
    assert not tuning.needs_tuning("fwd", 64, torch.float16, False, 1024, cuda)  # cached now
    # unset: the cache is used, nothing tuned; "0": the table only
    monkeypatch.delenv("FLASHTILE_AUTOTUNE")
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) == D64_FWD[0]
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    assert tuning.lookup("fwd", 64, torch.float16, False, 1024) is None
    with tuning._forcing(["fwd"]):  # tune() overrides the flag for its passes only
        assert tuning.needs_tuning("fwd", 64, torch.float16, True, 1024, cuda)
        assert not tuning.needs_tuning("bwd", 64, torch.float16, True, 1024, cuda)


def test_lookup_memo_follows_the_entries_and_the_environment(cache, monkeypatch):
    """lookup remembers its answer per key on a CUDA device (a call of another length in the same bucket does not
    read the entries again) until the entries change (a stored winner, _reset), or FLASHTILE_AUTOTUNE, the cache
    directory or the device differ; while tune() forces a pass nothing is remembered."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    reads = []
    real = tuning._lookup
    monkeypatch.setattr(tuning, "_lookup", lambda *a: reads.append(a) or real(*a))

    def ask(seqlen=1024):
        return tuning.lookup("fwd", 64, torch.float16, False, seqlen)
    assert ask() is None and len(reads) == 1
    tuning.tune_key("fwd", 64, torch.float16, False, 1024, _fake_bench(D64_MS, failing=[D64_FWD[0]]))
    assert ask(1000) == D64_FWD[2] and len(reads) == 2         # the stored winner cleared the memo
    assert ask(600) == D64_FWD[2] and len(reads) == 2          # same bucket (1024): remembered
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "0")
    assert ask() is None and len(reads) == 3
    monkeypatch.delenv("FLASHTILE_AUTOTUNE")
    assert ask() == D64_FWD[2] and len(reads) == 3
    device[0] = 1
    assert ask() == D64_FWD[2] and len(reads) == 4
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(cache / "other"))
    assert ask() is None and len(reads) == 5                   # another cache file: nothing tuned there
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(cache))
    tuning._reset()
    assert ask() == D64_FWD[2] and len(reads) == 6             # read from disk again
    with tuning._forcing(["fwd"]):
        ask(), ask()
    assert len(reads) == 8


def test_launch_configs_use_cached_winner_first(cache):
    assert launch.fwd_config(64, torch.float16, False, seqlen=3000) == Config(128, 64, 4, 3)  # table
    tuning.tune_key("fwd", 64, torch.float16, False, 3000, _fake_bench(D64_MS, failing=[D64_FWD[0]]))
    bwd_ms = {c: 1.0 + i for i, c in enumerate(tuning.BWD[256])}
    tuning.tune_key("bwd", 256, torch.float16, True, 3000, _fake_bench(bwd_ms))
    assert launch.fwd_config(64, torch.float16, False, seqlen=4096) == D64_FWD[2]
    assert launch.fwd_config(64, torch.float16, False) == Config(128, 64, 4, 3)  # seqlen unknown: the table
    assert launch.fwd_config(64, torch.float16, True, seqlen=4096) == Config(64, 64, 4, 3)  # not tuned: the table
    assert launch.bwd_config(256, torch.float16, True, seqlen=2500) == tuning.BWD[256][0]
    assert launch.bwd_config(256, torch.float16) == Config(64, 64, 4, 2, split_dkdv=True, dq=(64, 32, 4, 3),
                                                               dv=(128, 8, 2))  # the table (full)
    configs.CONFIG_OVERRIDE["fwd"] = Config(16, 16, 1, 1)
    assert launch.fwd_config(64, torch.float16, False, seqlen=4096) == Config(16, 16, 1, 1)  # a pin beats the cache


def test_autotune_pins_each_candidate_and_restores_override(cache, monkeypatch):
    """The launchers' hook: run() sees configs.CONFIG_OVERRIDE pinned to the candidate being timed (what its
    re-launch then uses), the table's config is a candidate, and the caller's override survives."""
    seen = []
    ms = {c: 5.0 for c in tuning.BWD[64]}
    table = Config(16, 16, 2, 1)
    ms[table] = 1.0
    monkeypatch.setattr(tuning, "benchmark_ms", lambda fn: (fn(), ms[seen[-1]])[1])
    configs.CONFIG_OVERRIDE["fwd"] = Config(32, 32, 4, 1)

    def run():
        seen.append(launch.bwd_config(64, torch.float16, False, seqlen=1024))
    assert tuning.autotune("bwd", 64, torch.float16, False, 1024, run, default=table) == table
    assert seen == tuning.BWD[64] + [table]
    assert configs.CONFIG_OVERRIDE == {"fwd": Config(32, 32, 4, 1)}
    assert tuning.lookup("bwd", 64, torch.float16, False, 1024) == table


def test_tune_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        tuning.tune(head_dims=(64,))
