"""scripts/test.sh and the suite's report: --quick selects a first check, no flag the whole suite, and the
skips are summed up one line per reason."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SKIPPING = '''
import pytest

@pytest.mark.parametrize("n", range(3))
def test_needs_a_gpu(n):
    pytest.skip("no CUDA device")

def test_needs_another_gpu():
    pytest.skip("no CUDA device")

@pytest.mark.skipif(True, reason="not on this machine")
def test_elsewhere():
    pass

def test_runs():
    pass
'''


def test_skips_are_summed_up_one_line_per_reason(tmp_path):
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pytest.ini"), "--rootdir", str(tmp_path),
                           "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", str(tmp_path / "test_skipping.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED [" not in done.stdout, done.stdout
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "5 skipped, by reason" in line)
    assert [line.strip() for line in lines[start + 1:start + 3]] == ["4  no CUDA device", "1  not on this machine"]


def _collected(*args: str) -> list:
    """The test ids `bash scripts/test.sh ARGS --collect-only` lists (test.sh passes -q)."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), *args, "--collect-only"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_quick_selects_a_part_of_the_whole_suite():
    whole, quick = _collected(), _collected("--quick")
    assert set(quick) < set(whole)
    files = {test.split("::")[0] for test in quick}
    # The deep_ep surface, the calls against the reference, bad input, megatron's dispatcher.
    assert {"tests/test_v1_surface.py", "tests/test_normal.py", "tests/test_errors.py",
            "tests/test_megatron.py"} <= files, files
    assert all(re.fullmatch(r"tests/test_\w+\.py", f) for f in files), files
    assert len(quick) >= 100
