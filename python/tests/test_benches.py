"""The issue-32 benchmarks run end to end, at toy sizes, on the device: a benchmark that no longer
runs (an API it calls changed, a pipeline it builds broke) fails here rather than in the session
that needs its figures. Nothing is timed or compared with a speed; the outputs are checked for
shape and sense (every pipeline reported, byte identity, positive rates). Skipped without a GPU,
torch or torchvision.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import make_jpegs, needs_gpu

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


def run_bench(script, *args, timeout=600):
    """Runs python/bench/<script> with this interpreter and environment; its stdout, or the
    failure with both streams."""
    p = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p.stdout


def lines(stdout, tag):
    return [json.loads(line[len(tag) + 1:]) for line in stdout.splitlines() if line.startswith(tag + " ")]


def image_folder(root, classes=2, per_class=24):
    """An ImageFolder tree of varied-size JPEGs."""
    for c in range(classes):
        d = os.path.join(root, f"class{c}")
        os.makedirs(d)
        make_jpegs(d, per_class, seed=3 + c, side=(120, 360))


@needs_gpu
def test_train_feed_runs_every_pipeline(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    root = tmp_path / "set"
    image_folder(str(root))
    out = run_bench("train_feed.py", "--root", str(root), "--model", "resnet18", "--batch", "8",
                    "--steps", "3", "--warmup", "1", "--threads", "2", "--workers", "2",
                    "--only", "ideal,pinstream,discard,replay,torch,ideal", "--timeline")
    got = lines(out, "TRAIN_JSON")
    names = [r["pipeline"] for r in got]
    assert names == ["ideal", "pinstream_auto", "discard_auto", "replay", "torch_dataloader_apex", "ideal"], names
    for r in got:
        assert r["images"] == 3 * 8 and r["images_per_s"] > 0 and r["ratio_to_ideal"] > 0, r
        t = r.get("timeline")
        assert t and t["steps"] == 16 and t["span_ms_per_step"] > 0, r
        assert t["step_stream_busy_ms_per_step"] <= t["span_ms_per_step"] + 1e-6, t
    assert got[1]["decoding"] in ("gpu", "cpu")
    assert min(r["ratio_to_ideal"] for r in got if r["pipeline"] == "ideal") == 1.0


@needs_gpu
def test_train_feed_pinned_and_in_a_helper_process(tmp_path):
    """``--pin`` (the training thread on one CPU, the feed's ``cpus=`` the others) and the
    ``ipc`` experiment (the feed in a helper process, batches by CUDA IPC) run and report."""
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 4:
        pytest.skip("fewer than 4 CPUs: nothing left beside the training thread and its sibling")
    root = tmp_path / "set"
    image_folder(str(root))
    out = run_bench("train_feed.py", "--root", str(root), "--model", "resnet18", "--batch", "8",
                    "--steps", "3", "--warmup", "1", "--threads", "2", "--pin", str(cpus[-1]),
                    "--only", "ideal,pinstream,ipc")
    got = lines(out, "TRAIN_JSON")
    assert [r["pipeline"] for r in got] == ["ideal", "pinstream_auto", "pinstream_ipc"], got
    for r in got:
        assert r["images"] == 3 * 8 and r["images_per_s"] > 0 and r["ratio_to_ideal"] > 0, r


@needs_gpu
def test_train_feed_with_the_step_on_a_green_context(tmp_path):
    """``--green-step N``: the step on a stream of a CUDA green context of about N SMs (the
    feed's batches ordered on it), with an ``ideal_green`` pipeline beside the plain ideal."""
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    root = tmp_path / "set"
    image_folder(str(root))
    out = run_bench("train_feed.py", "--root", str(root), "--model", "resnet18", "--batch", "8",
                    "--steps", "3", "--warmup", "1", "--green-step", "64", "--graph",
                    "--only", "ideal,ideal_green,pinstream")
    got = lines(out, "TRAIN_JSON")
    assert [r["pipeline"] for r in got] == ["ideal", "ideal_green", "pinstream_auto"], got
    for r in got:
        assert r["images"] == 3 * 8 and r["images_per_s"] > 0 and r["ratio_to_ideal"] > 0, r
    assert got[1]["green_sms"] == 64 and got[2]["green_sms"] == 64
    assert any(line.startswith("GREEN step on ") for line in out.splitlines())


def test_train_feed_refuses_a_green_eager_step():
    """``--green-step`` without ``--graph`` is refused before anything runs (no GPU needed): the
    eager step's cuDNN kernels fail on a green-context stream."""
    r = subprocess.run([sys.executable, os.path.join(BENCH, "train_feed.py"), "--root", "/nonexistent",
                        "--green-step", "64"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--green-step needs --graph" in r.stderr, (r.returncode, r.stderr[-2000:])


@needs_gpu
def test_sharded_load_runs_and_is_byte_identical(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    out = run_bench("sharded_load.py", "--toy", "--size-gb", "0.02", "--shard-gb", "0.004", "--dir",
                    str(tmp_path / "ckpt"), "--repeat", "1", "--cold-repeat", "1")
    r = json.loads(out.strip().splitlines()[-1])
    assert r["bench"] == "sharded_load" and r["shards"] >= 3, r
    assert r["byte_identical"] is True, r
    for way in ("pinstream", "pinstream_never", "pinstream_per_shard", "load_file", "safe_open", "mmap_to"):
        assert r["warm_gbps"][way] > 0, (way, r)
    assert r["cold_gbps"]["pinstream_auto"] > 0, r
    assert not os.path.exists(tmp_path / "ckpt" / "model.safetensors.index.json")


def adjacent(stdout):
    """The ADJACENT lines of train_feed.py: {pipeline: [ratios]}."""
    got = {}
    for line in stdout.splitlines():
        if line.startswith("ADJACENT "):
            name, _, rest = line[len("ADJACENT "):].partition(": median ")
            got[name] = [float(x) for x in rest.split(": ", 1)[1].split(" (")[0].split()]
    return got


@needs_gpu
def test_train_feed_beside_busy_neighbours_with_the_adjacent_ratio(tmp_path):
    """The ninth session's pipelines (the ideal beside CPU burners, beside another process's
    tiny kernels, beside a thread's small GPU operations, beside ``discard``) run, and each non-ideal pipeline gets its ratio over the
    mean of the ideals beside it: a pipeline between two ideals over their mean, one at an end
    over its one neighbour."""
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    root = tmp_path / "set"
    image_folder(str(root))
    out = run_bench("train_feed.py", "--root", str(root), "--model", "resnet18", "--batch", "8",
                    "--steps", "3", "--warmup", "1", "--threads", "2",
                    "--only", "ideal,ideal_spin1,ideal,ideal_mem1,ideal,ideal_kernproc,ideal,"
                    "ideal_smallops_both@2000,ideal,discard,ideal,discard+t1")
    got = lines(out, "TRAIN_JSON")
    names = [r["pipeline"] for r in got]
    assert names == ["ideal", "ideal_spin1", "ideal", "ideal_mem1", "ideal", "ideal_kernproc1000",
                     "ideal", "ideal_smallops_both@2000", "ideal", "discard_auto", "ideal",
                     "discard_auto+t1"], names
    # `+t1`: that pipeline's feed with one thread, the others with --threads.
    assert got[9]["threads"] == 2 and got[11]["threads"] == 1, (got[9], got[11])
    for i, r in enumerate(got):
        assert r["images"] == 3 * 8 and r["images_per_s"] > 0, r
        ideals = [got[j]["step_ms"] for j in (i - 1, i + 1) if 0 <= j < len(got) and got[j]["pipeline"] == "ideal"]
        if r["pipeline"] != "ideal":
            want = r["step_ms"] / (sum(ideals) / len(ideals))
            assert abs(r["ratio_adjacent"] - want) <= 1e-3 * want + 1e-4, (r, ideals)
    assert got[7]["small_ops_per_s"] > 0, got[7]
    adj = adjacent(out)
    assert set(adj) == {"ideal_spin1", "ideal_mem1", "ideal_kernproc1000", "ideal_smallops_both@2000",
                        "discard_auto", "discard_auto+t1"}, adj
    assert all(len(v) == 1 and v[0] > 0 for v in adj.values()), adj


@needs_gpu
def test_train_feed_with_the_cache(tmp_path):
    """``pinstream+cache1``: the feed with a 1 GiB cache of decoded images, filled by one epoch
    before the timed steps, which then decode nothing; the cache's stats in the JSON."""
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    root = tmp_path / "set"
    image_folder(str(root))
    out = run_bench("train_feed.py", "--root", str(root), "--model", "resnet18", "--batch", "8",
                    "--steps", "3", "--warmup", "1", "--threads", "2",
                    "--only", "ideal,pinstream+cache1,ideal")
    got = lines(out, "TRAIN_JSON")
    assert [r["pipeline"] for r in got] == ["ideal", "pinstream_auto+cache1", "ideal"], got
    c = got[1].get("cache")
    if got[1].get("decoding") != "gpu":
        pytest.skip("the feed decodes on the CPU here")
    assert c["cache_budget"] == 1 << 30 and c["cache_images"] > 0 and c["cache_hits"] > 0, c


@needs_gpu
def test_train_feed_beside_decode_loop(tmp_path):
    """``ideal_decloop@RATE``: the ideal beside `vision/examples/decode_loop` (the packed
    program), which decodes at about RATE images/s and says so."""
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    binary = os.path.join(BENCH, "..", "..", ".gpu", "bin", "decode_loop")
    if not os.path.exists(binary):
        pytest.skip("no packed decode_loop (../shared/gpu/pack builds it)")
    root = tmp_path / "set"
    image_folder(str(root))
    out = run_bench("train_feed.py", "--root", str(root), "--model", "resnet18", "--batch", "8",
                    "--steps", "3", "--warmup", "1", "--threads", "1",
                    "--only", "ideal,ideal_decloop@400,ideal")
    got = lines(out, "TRAIN_JSON")
    assert [r["pipeline"] for r in got] == ["ideal", "ideal_decloop@400", "ideal"], got
    rates = [int(x) for x in got[1]["decode_loop_images_per_s"]]
    assert rates and max(rates) > 0 and max(rates) <= 2 * 400 + 256, rates


@needs_gpu
def test_vs_torch_models_with_the_ideal_as_its_own_control():
    """``vs_torch.py --only models`` with ``ideal_again``: both ratios (over the faster ideal
    beside each round, over their mean) per round, the mean's never above the faster's."""
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    controls = ["ideal_again", "ideal_dl4_discard", "ideal_dl4_discard_child", "dl4_views_worker_ring_copy1",
                "ideal_dl4s_discard", "dl4s_worker_ring", "dl4s_worker_ring_unstacked", "apex_dl4s_pin"]
    out = run_bench("vs_torch.py", "--only", "models", "--quick", "--models", "resnet18",
                    "--model-sources", ",".join(controls), "--model-rounds", "2", "--model-steps", "2",
                    "--model-warmup", "1")
    r = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    # The tenth session's controls ran too (the child's raises unless it took the batches), and
    # the eleventh's sources over a dataset of single images (their first batch checked).
    assert set(r["resnet18"]["of_adjacent_rounds"]) == set(controls), r
    for name in controls:
        rounds = r["resnet18"]["of_ideal_rounds"][name]
        adj = r["resnet18"]["of_adjacent_rounds"][name]
        assert len(rounds) == len(adj) == 2, r
        assert all(0 < a <= b + 1e-3 for a, b in zip(adj, rounds)), (name, adj, rounds)
    assert "child_took" in out, out[-3000:]


def test_train_feed_pipeline_flags():
    """A pipeline name's flags (no GPU): switches of the diagnostic build as PINSTREAM_DIAG_*
    variables, ``cpuNN`` as a share, ``tN`` as the feed's threads; anything else refused."""
    sys.path.insert(0, BENCH)
    try:
        import train_feed
    finally:
        sys.path.remove(BENCH)
    env, opts = train_feed.pipeline_flags(["yuv", "cpu25", "t8", "cache3"])
    assert env == {"PINSTREAM_DIAG_YUV": "1", "PINSTREAM_DIAG_CPU_SHARE": "0.25"}
    assert opts == {"threads": 8, "cache_gib": 3}
    assert train_feed.pipeline_flags([]) == ({}, {"threads": None, "cache_gib": 0})
    for bad in (["cpu101"], ["t0"], ["cpu_share"], ["tx"], ["YUV"], ["cpu"], ["t1234"], ["cache0"],
                ["cache"], ["cache12345"]):
        with pytest.raises(SystemExit):
            train_feed.pipeline_flags(bad)
