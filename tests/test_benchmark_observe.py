"""`moe-ep-bench observe` on CPU ranks: every kind of call timed under each observation setting in one run,
the settings' ratios from that run; and what each setting turns on and leaves behind."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_ep.bench import observe

ROOT = Path(__file__).resolve().parents[1]


def test_each_kind_is_timed_under_each_setting(tmp_path):
    jsonl = tmp_path / "o.jsonl"
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "observe", "--cpu", "--ranks", "2", "--tokens", "16",
                           "--hidden", "256", "--experts", "8", "--topk", "2", "--warmup", "1", "--iters", "2",
                           "--repeats", "2", "--jsonl", str(jsonl)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for kind in observe.KINDS:
        us = {r["backend"]: r for r in records if r["mode"] == kind and r["metric"] == "us_per_round"}
        ratios = {r["backend"]: r["value"] for r in records if r["mode"] == kind and r["metric"] == "vs_off"}
        assert set(us) == set(ratios) == set(observe.SETTINGS)
        assert all(r["value"] > 0 and len(r["per_rank"]) == 2 for r in us.values())
        assert ratios["off"] == 1.0
        for setting in observe.SETTINGS:
            assert ratios[setting] == pytest.approx(us[setting]["value"] / us["off"]["value"])
    assert done.stdout.count("observation cost: 2 CPU ranks") == 1


class _Recorder:
    def __init__(self):
        self.calls = []

    def reset_stats(self, collect=True):
        self.calls.append(("reset_stats", collect))

    def profile(self):
        import contextlib
        self.calls.append(("profile",))
        return contextlib.nullcontext()


@pytest.mark.parametrize("setting, calls", [("off", []), ("stats", [("reset_stats", True), ("reset_stats", False)]),
                                            ("profile", [("profile",)])])
def test_a_setting_observes_only_inside_and_stops_after(setting, calls):
    buffer = _Recorder()
    with pytest.raises(RuntimeError):
        with observe.observed(buffer, setting):
            raise RuntimeError("a call failed")  # collection stops all the same
    assert buffer.calls == calls
