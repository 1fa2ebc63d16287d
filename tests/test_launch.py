"""The launcher's SM share for ranks that share a GPU (moe_ep.launch --sm-share, moe_ep.mps)."""
import argparse

import pytest

from moe_ep.launch import RankPool, sm_share, sm_share_env
from moe_ep.mps import bf16_share_warning, client_sm_share, missing_sm_share, process_sm_share


def test_each_rank_leaves_the_others_kernels_their_sms():
    # A rank's intranode kernels hold at most 1 / 2R of the SMs; the other R - 1 ranks' kernels and one
    # rank's share must fit the GPU together.
    for ranks in range(2, 17):
        share = client_sm_share(ranks)
        assert share / 100 + (ranks - 1) / (2 * ranks) <= 1, ranks
        assert share / 100 > 0.5  # still most of a GPU for a rank's own GEMMs
    assert client_sm_share(1) == 100 and client_sm_share(4) == 62 and client_sm_share(8) == 56


def test_sm_share_option():
    assert sm_share("70", 4) == 70 and sm_share("100", 4) == 100
    assert sm_share_env("70", 4) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"} and sm_share_env("100", 4) == {}
    for bad in ("0", "101", "most"):
        with pytest.raises(SystemExit, match="--sm-share: expected auto or a percentage from 1 to 100"):
            sm_share(bad, 4)


def _ranks_share(tmp_path, *launch_args, env=None) -> set:
    """What CUDA_MPS_ACTIVE_THREAD_PERCENTAGE two ranks of `moe_ep.launch --mps on` see (no GPU here: the
    MPS branch runs without a daemon to start)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "share.py"
    script.write_text("import os, pathlib\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'rank' + os.environ['RANK']).write_text("
                      "os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', 'unset'))\n")
    environment = {k: v for k, v in os.environ.items() if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    environment.update(env or {})
    subprocess.run([sys.executable, "-m", "moe_ep.launch", "--nproc", "2", "--mps", "on", *launch_args, str(script)],
                   env=environment, check=True, timeout=120)
    return {(tmp_path / f"rank{r}").read_text() for r in range(2)}


def test_the_launcher_hands_each_rank_its_share(tmp_path):
    auto = sm_share("auto", 2)  # 75 where both ranks share a GPU (or there is none), else 100: no cap
    assert _ranks_share(tmp_path) == {str(auto) if auto < 100 else "unset"}
    assert _ranks_share(tmp_path, "--sm-share", "100") == {"unset"}
    assert _ranks_share(tmp_path, "--sm-share", "70") == {"70"}
    assert _ranks_share(tmp_path, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}) == {"40"}  # the user's wins


def test_training_on_a_shared_gpu_without_a_share_is_told_how_to_set_one():
    message = missing_sm_share(4, {})
    assert "4 ranks share this GPU and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is not set" in message
    assert "python -m moe_ep.launch, or set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=62" in message
    assert missing_sm_share(4, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "62"}) is None
    assert missing_sm_share(1, {}) is None


def test_bf16_under_an_sm_share_is_warned_about():
    """bf16 GEMMs went wrong under a share on an H200: a bf16 rank under one is told, no other rank."""
    message = bf16_share_warning(True, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"})
    assert "bf16 under an SM share of 75%" in message and "--sm-share 100" in message
    assert bf16_share_warning(False, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"}) is None
    assert bf16_share_warning(True, {}) is None
    assert bf16_share_warning(True, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}) is None


def test_the_megatron_benchmarks_run_bf16_without_a_share(monkeypatch):
    """--sm-share auto gives bf16 runs no share; a share given explicitly stays."""
    from moe_ep.bench import megatron_layer
    envs = []
    monkeypatch.setattr(megatron_layer, "gpus_of_the_ranks", lambda: 1)
    monkeypatch.setattr(megatron_layer, "start_ranks", lambda ranks, use_cuda, env: envs.append(env))
    for bf16, share in ((True, "auto"), (False, "auto"), (True, "70")):
        megatron_layer.megatron_ranks(argparse.Namespace(cpu=False, ranks=4, sm_share=share), bf16)
    assert envs == [{}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm_share("auto", 4))},
                    {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"}]


def test_a_cuda_rank_pool_without_a_gpu_says_so(monkeypatch):
    """Rather than ranks that each die picking a GPU (a ZeroDivisionError over zero devices)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"RankPool: use_cuda=True needs a GPU, and torch sees none here"):
        RankPool(2, use_cuda=True)


def test_a_process_reads_its_share_for_the_residency_check():
    assert process_sm_share({}) == 100 and process_sm_share({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "56"}) == 56
    # Rounded up: the whole GPU estimated from the reported SMs must err low.
    assert process_sm_share({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "62.5"}) == 63
    for bad in ("0", "150", "most", ""):
        assert process_sm_share({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": bad}) == 100, bad


def test_a_rank_that_dies_is_reported_lost():
    """A rank process killed in a call: the pool reports that rank lost (its exit code), not a broken pipe
    of its own."""
    from moe_ep.launch import RankError

    from . import rank_fns

    with RankPool(3) as pool:
        with pytest.raises(RankError) as lost:
            pool.run(rank_fns.killed_on_rank, 1)
    assert [(f.rank, f.type_name) for f in lost.value.failures] == [(1, "RankLost")], str(lost.value)
    assert "exited with code -9" in lost.value.failures[0].message
