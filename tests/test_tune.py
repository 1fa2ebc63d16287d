"""The config cache (moe_ep.tuning) and `moe-ep-bench tune`, on CPU: what the cache holds is what
Buffer.get_dispatch_config / get_combine_config give in a fresh process; without one, the built-in
defaults; a corrupt file warns once and changes nothing; writes merge. The tuning's figures are not
checked (CPU ranks on the portable backend)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_ep import tuning
from moe_ep.bench import report
from moe_ep.config import Config

ROOT = Path(__file__).resolve().parents[1]
FIELDS = tuning.CONFIG_FIELDS
# The built-in configs at 20 SMs: (dispatch, combine) as (send, recv) chunks, per rank count.
BUILT_IN = {2: ((24, 256), (10, 1024)), 4: ((6, 256), (32, 64)), 8: ((6, 256), (16, 64)), 3: ((6, 256), (16, 256))}

# Prints the configs a fresh process gets, at the default SM budget and at each budget in argv[1:].
SHOW = """
import json, sys, warnings
warnings.simplefilter("always")
from moe_ep import Buffer
from moe_ep.buffer import default_config_size_hints
from moe_ep.config import DEFAULT_NUM_SMS
assert Buffer.num_sms == DEFAULT_NUM_SMS
out = {}
for sms in [None] + [int(a) for a in sys.argv[1:]]:
    if sms is not None:
        Buffer.set_num_sms(sms)
    for n in (2, 3, 4, 8):
        for kind, get in (("dispatch", Buffer.get_dispatch_config), ("combine", Buffer.get_combine_config)):
            out[f"{sms} {n} {kind}"] = list(vars(get(n)).values())
            get(n)  # a second read: no second warning
out["hints"] = list(default_config_size_hints(512, 2))
print(json.dumps(out))
"""


def _configs(cache, *sms, extra_env=None):
    """(configs by "sms ranks kind", stderr) of a fresh CPU process reading `cache` (None: variable unset)."""
    env = {k: v for k, v in os.environ.items() if k != tuning.CACHE_ENV}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **(extra_env or {}))
    if cache is not None:
        env[tuning.CACHE_ENV] = str(cache)
    done = subprocess.run([sys.executable, "-c", SHOW, *map(str, sms)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done.stderr


def _built_in(num_ranks, kind, num_sms=20):
    send, recv = BUILT_IN[num_ranks][kind == "combine"]
    return [num_sms, send, recv, 6, 128]


def _entry(kind, num_ranks, config, by_sms=(), device="cpu"):
    return {tuning.entry_key(device, num_ranks, num_ranks, kind): dict(
        device=device, num_ranks=num_ranks, ranks_per_gpu=num_ranks, kind=kind, config=dict(zip(FIELDS, config)),
        by_sms={str(c[0]): dict(zip(FIELDS, c)) for c in by_sms})}


def test_without_a_cache_the_built_in_defaults(tmp_path):
    """No file (at the variable's path, or at the default path under XDG_CACHE_HOME), or an empty variable:
    exactly the built-in configs, at the default budget and at one set_num_sms chose."""
    for cache, env in ((tmp_path / "none.json", {}), (None, {"XDG_CACHE_HOME": str(tmp_path)}), ("", {})):
        configs, stderr = _configs(cache, 32, extra_env=env)
        assert "Warning" not in stderr, stderr
        for n in (2, 3, 4, 8):
            for kind in ("dispatch", "combine"):
                assert configs[f"None {n} {kind}"] == _built_in(n, kind)
                assert configs[f"32 {n} {kind}"] == _built_in(n, kind, 32)


def test_cache_path(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "c.json"))
    assert tuning.cache_path() == tmp_path / "c.json"
    monkeypatch.setenv(tuning.CACHE_ENV, "")
    assert tuning.cache_path() is None
    monkeypatch.delenv(tuning.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_path() == tmp_path / "moe_ep" / "configs.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_path() == tmp_path / "home" / ".cache" / "moe_ep" / "configs.json"


def test_cache_round_trip(tmp_path):
    """Entries written for 2 ranks on this machine ("cpu") come back from get_*_config in a fresh process:
    the tuned budget by default, the chunks tuned at a budget set_num_sms chose, the tuned chunks at a
    budget not tried; other rank counts keep the built-in configs, and the size hints follow."""
    cache = tmp_path / "sub" / "configs.json"
    tuning.write_entries({**_entry("dispatch", 2, [24, 8, 512, 6, 128], by_sms=[[16, 4, 128, 6, 128]]),
                          **_entry("combine", 2, [32, 16, 64, 6, 128])}, cache)
    configs, stderr = _configs(cache, 16, 40)
    assert "Warning" not in stderr, stderr
    assert configs["None 2 dispatch"] == [24, 8, 512, 6, 128]
    assert configs["None 2 combine"] == [32, 16, 64, 6, 128]
    assert configs["16 2 dispatch"] == [16, 4, 128, 6, 128]  # tuned at 16 SMs
    assert configs["16 2 combine"] == [16, 16, 64, 6, 128]  # not tried at 16: the tuned chunks
    assert configs["40 2 dispatch"] == [40, 8, 512, 6, 128]
    for n in (3, 4, 8):
        assert configs[f"None {n} dispatch"] == _built_in(n, "dispatch")
        assert configs[f"40 {n} combine"] == _built_in(n, "combine", 40)
    # Sized at the last budget (40 SMs): the larger of the two tuned configs' hints.
    hint = max(Config(40, 8, 512, 6, 128).get_nvl_buffer_size_hint(512, 2),
               Config(40, 16, 64, 6, 128).get_nvl_buffer_size_hint(512, 2))
    assert configs["hints"] == [hint, 0]
    # Another machine's entries are not this one's.
    other = tmp_path / "other.json"
    tuning.write_entries(_entry("dispatch", 2, [24, 8, 512, 6, 128], device="NVIDIA H200"), other)
    configs, _ = _configs(other)
    assert configs["None 2 dispatch"] == _built_in(2, "dispatch")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"version": 99, "entries": {}}', "\xff\xfe"])
def test_a_corrupt_cache_warns_once_and_gives_the_defaults(tmp_path, text):
    cache = tmp_path / "configs.json"
    cache.write_text(text, encoding="latin-1")
    configs, stderr = _configs(cache, 16)
    assert stderr.count("UserWarning") == 1 and str(cache) in stderr, stderr
    for n in (2, 3, 4, 8):
        assert configs[f"None {n} combine"] == _built_in(n, "combine")
        assert configs[f"16 {n} dispatch"] == _built_in(n, "dispatch", 16)


def test_an_invalid_entry_is_ignored_with_a_warning(tmp_path):
    """An entry that is not a valid Config (send chunk not below the receive chunk) is dropped; the valid
    ones of the same file apply."""
    cache = tmp_path / "configs.json"
    good = _entry("combine", 2, [32, 16, 64, 6, 128])
    bad = _entry("dispatch", 2, [24, 64, 64, 6, 128])
    cache.write_text(json.dumps({"version": tuning.VERSION, "entries": {**good, **bad}}))
    configs, stderr = _configs(cache)
    assert stderr.count("UserWarning") == 1 and "ignoring invalid entries" in stderr, stderr
    assert configs["None 2 combine"] == [32, 16, 64, 6, 128]
    assert configs["None 2 dispatch"] == _built_in(2, "dispatch")
    with pytest.raises(ValueError):
        tuning.write_entries(bad, tmp_path / "refused.json")
    assert not (tmp_path / "refused.json").exists()


def test_writes_merge_and_replace_atomically(tmp_path):
    cache = tmp_path / "configs.json"
    tuning.write_entries({**_entry("dispatch", 2, [24, 8, 512, 6, 128]), **_entry("combine", 4, [24, 8, 64, 6, 128])},
                         cache)
    tuning.write_entries({**_entry("dispatch", 2, [16, 4, 256, 6, 128]), **_entry("combine", 8, [32, 16, 64, 6, 128])},
                         cache)
    entries = json.loads(cache.read_text())["entries"]
    assert sorted(entries) == sorted([tuning.entry_key("cpu", 2, 2, "dispatch"), tuning.entry_key("cpu", 4, 4, "combine"),
                                      tuning.entry_key("cpu", 8, 8, "combine")])
    assert entries[tuning.entry_key("cpu", 2, 2, "dispatch")]["config"]["num_sms"] == 16  # replaced
    assert [p.name for p in tmp_path.iterdir()] == ["configs.json"]  # no temporary file left
    # A corrupt file is replaced by the new entries, with a warning.
    cache.write_text("{not json")
    with pytest.warns(UserWarning, match="replacing it"):
        tuning.write_entries(_entry("combine", 2, [32, 16, 64, 6, 128]), cache)
    assert list(json.loads(cache.read_text())["entries"]) == [tuning.entry_key("cpu", 2, 2, "combine")]


def _tune(*args, cache=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env.pop(tuning.CACHE_ENV, None)
    if cache is not None:
        env[tuning.CACHE_ENV] = str(cache)
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "tune", "--cpu", "--ranks", "2", "--tokens", "32",
                           "--hidden", "256", "--experts", "16", "--topk", "4", "--warmup", "1", "--iters", "2",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_tune_command_writes_a_cache_that_get_config_reads(tmp_path):
    """`moe-ep-bench tune --cpu --ranks 2` on a tiny shape: a progress bar over its 1 + 2 x 2 candidates, a
    table, a JSON line per timed candidate and kind, and a cache (at $MOE_EP_CONFIG_CACHE, merged with an
    entry already there) whose configs a fresh process gets; --dry-run writes nothing."""
    cache = tmp_path / "configs.json"
    tuning.write_entries(_entry("combine", 4, [24, 8, 64, 6, 128]), cache)
    grid = ["--sms", "8", "16", "--recv-chunks", "32", "64", "--send-chunks", "4", "8"]
    done = _tune(*grid, "--json", str(tmp_path / "t.jsonl"), "--jsonl", str(tmp_path / "m.jsonl"), "--plot",
                 str(tmp_path / "plots"), cache=cache)
    assert "5/5" in done.stderr and "candidate" in done.stderr, done.stderr  # the progress bar
    assert f"wrote 2 entries to {cache}" in done.stdout, done.stdout
    entries = json.loads(cache.read_text())["entries"]
    assert tuning.entry_key("cpu", 4, 4, "combine") in entries  # kept
    dispatch, combine = (entries[tuning.entry_key("cpu", 2, 2, kind)] for kind in ("dispatch", "combine"))
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    # Dispatch: the default and 2 x 2 (budget, receive chunk); combine: the default and 2 x 2 x 2 send chunks.
    assert sum(line["kind"] == "dispatch" for line in lines) == 5 and sum(line["kind"] == "combine" for line in lines) == 9
    for entry in (dispatch, combine):
        tried = [line for line in lines if line["kind"] == entry["kind"]]
        fastest = max(tried, key=lambda line: line["gbps_per_rank"])
        assert entry["gbps_per_rank"] == fastest["gbps_per_rank"]
        assert (entry["config"]["num_sms"], entry["config"]["num_max_nvl_chunked_recv_tokens"],
                entry["config"]["num_max_nvl_chunked_send_tokens"]) == (fastest["sms"], fastest["recv_tokens"],
                                                                        fastest["send_tokens"])
        assert sorted(entry["by_sms"], key=int) == ["8", "16", "20"]
        assert entry["command"].startswith("moe-ep-bench tune --cpu --ranks 2")
        row = f"{entry['config']['num_sms']:>4} {entry['config']['num_max_nvl_chunked_recv_tokens']:>5}"
        assert f"2       2 {entry['kind']:>8} {row}" in done.stdout, done.stdout
    # The same figures as measurements (report.py's JSON lines), and their SM sweep plotted where matplotlib is.
    measured = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted((m["shape"]["sms"], m["shape"]["recv_tokens"], m["shape"]["send_tokens"], m["kind"], m["value"])
                  for m in measured) == sorted((line["sms"], line["recv_tokens"], line["send_tokens"], line["kind"],
                                                line["gbps_per_rank"]) for line in lines)
    assert all(m["benchmark"] == "tune" and m["metric"] == "gbps_per_rank" and m["unit"] == "GB/s" for m in measured)
    plot = tmp_path / "plots" / "tune_2ranks_sms.png"
    assert plot.read_bytes().startswith(b"\x89PNG") if not report.matplotlib_missing() else not plot.exists()
    configs, _ = _configs(cache)
    assert configs["None 2 dispatch"] == [dispatch["config"][f] for f in FIELDS]
    assert configs["None 2 combine"] == [combine["config"][f] for f in FIELDS]

    before = cache.read_text()
    done = _tune("--sms", "8", "--recv-chunks", "32", "--send-chunks", "4", "--dry-run", cache=cache)
    assert "dry run: 2 entries not written" in done.stdout and cache.read_text() == before


def test_tune_needs_a_place_to_write():
    done = subprocess.run([sys.executable, "-m", "moe_ep.bench", "tune", "--cpu", "--ranks", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, tuning.CACHE_ENV: "", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and "pass --cache PATH or --dry-run" in done.stderr, done.stderr
