"""`moe-ep-bench observe` on CPU ranks: every kind of call timed under each observation setting in one run,
the settings' ratios from that run; and what each setting turns on and leaves behind."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_ep.bench import observe

ROOT = Path(__file__).resolve().parents[1]


def test_without_options_on_a_cpu_machine_each_kind_is_timed_under_each_setting(tmp_path):
    """The README's command as it stands, on a machine without a GPU: its CPU defaults finish it."""
    jsonl = tmp_path / "o.jsonl"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "observe", "--jsonl", str(jsonl)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Seconds on an idle two-core machine; the bound leaves room for a loaded one.
    assert time.monotonic() - started < 120
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for kind in observe.KINDS:
        us = {r["backend"]: r for r in records if r["mode"] == kind and r["metric"] == "us_per_round"}
        ratios = {r["backend"]: r["value"] for r in records if r["mode"] == kind and r["metric"] == "vs_off"}
        assert set(us) == set(ratios) == set(observe.SETTINGS)
        assert all(r["value"] > 0 and len(r["per_rank"]) == 2 for r in us.values())
        assert ratios["off"] == 1.0
        for setting in observe.SETTINGS:
            assert ratios[setting] == pytest.approx(us[setting]["value"] / us["off"]["value"])
    assert done.stdout.count("observation cost: 2 CPU ranks, 64 tokens x 256 bf16, top-4 of 16 experts") == 1
    assert "CPU ranks run the portable backend" in done.stdout


def test_options_left_out_take_the_devices_defaults(monkeypatch):
    monkeypatch.setattr(observe.torch.cuda, "is_available", lambda: False)
    args = observe.parse_args(["--tokens", "32"])
    assert args.cpu and args.tokens == 32
    assert {name: getattr(args, name) for name in observe.DEFAULTS["cpu"] if name != "tokens"} == {
        name: value for name, value in observe.DEFAULTS["cpu"].items() if name != "tokens"}
    monkeypatch.setattr(observe.torch.cuda, "is_available", lambda: True)
    assert vars(observe.parse_args([])).items() >= observe.DEFAULTS["cuda"].items()
    assert vars(observe.parse_args(["--cpu"])).items() >= observe.DEFAULTS["cpu"].items()


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
