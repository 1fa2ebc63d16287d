"""scripts/gpu_ab.sh, the A/B harness of the GPU calls, run here with a stand-in for python that records
what it is asked to do: a fault in the harness would otherwise show only on the GPU machine, where it
costs a call of scarce device time."""
import os
import pathlib
import shutil
import stat
import subprocess
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Builds print where they ran and with which MOE_EP_TIMELINE; benchmarks append a JSON line to --json;
# pytest fails in a tree holding FAIL_TESTS; everything else says what it was asked.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
  *setup.py*) echo "build in $PWD timeline=${MOE_EP_TIMELINE:-0}"; exit 0;;
  *"-m pytest"*) [[ -f FAIL_TESTS ]] && { echo "1 failed"; exit 1; }; echo "3 passed"; exit 0;;
  *ll_timeline*) echo "timeline in $PWD: $*"; exit 0;;
  *ab_summary.py*) echo "summary of $*"; exit 0;;
  *moe_ep.bench.low_latency*)
    prev=; for a in "$@"; do [[ $prev == --json ]] && echo '{}' >> "$a"; prev=$a; done; exit 0;;
esac
echo "unexpected: $*"; exit 3
"""


def _patch_creating(name: str, text: str) -> str:
    return (f"diff --git a/{name} b/{name}\nnew file mode 100644\n--- /dev/null\n+++ b/{name}\n"
            f"@@ -0,0 +1 @@\n+{text}\n")


@pytest.fixture
def harness(tmp_path):
    if subprocess.run(["bash", "-c", "command -v patch && command -v tar"], capture_output=True).returncode != 0:
        pytest.skip("needs patch and tar")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    ab = ROOT / "ab"
    ab.mkdir(exist_ok=True)
    patches = {"ab-test-good": _patch_creating("AB_TEST_MARKER", "good"),
               "ab-test-bad": _patch_creating("FAIL_TESTS", "bad")}
    for name, text in patches.items():
        (ab / f"{name}.patch").write_text(text)
    yield tmp_path, python
    for name in patches:
        (ab / f"{name}.patch").unlink(missing_ok=True)
    for tree in [f"/tmp/moe_ep_variant_{name}" for name in patches] + \
                [f"/tmp/moe_ep_timeline_{name}" for name in ["A", *patches]]:
        shutil.rmtree(tree, ignore_errors=True)


def test_gpu_ab_runs_variants_tests_and_timelines(harness):
    tmp_path, python = harness
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(python), AB_PATCHES="ab/ab-test-good.patch ab/ab-test-bad.patch",
               AB_INTRANODE="", AB_ROUNDS="1", AB_TESTS="tests -x", AB_TIMELINE="--ranks 8 --combine")
    done = subprocess.run(["bash", "scripts/gpu_ab.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "ab_summary.txt").read_text()
    # The variant whose tests failed is neither benchmarked nor timed; the others are, against A.
    assert "ab-test-bad: tests failed, not benchmarked" in done.stdout
    assert "summary of scripts/ab_summary.py" in summary and "ab_ab-test-good.jsonl" in summary
    assert "no benchmark figures for both" in summary.split("== ab-test-bad against A")[1]
    assert "== timeline of A" in summary and "== timeline of ab-test-good" in summary
    assert "timeline of ab-test-bad" not in summary
    assert "timeline in /tmp/moe_ep_timeline_ab-test-good: -m moe_ep.bench.ll_timeline --ranks 8 --combine" in summary
    # Only what is summarised and the archive come back; the archive holds each build's log, the
    # timeline builds made with MOE_EP_TIMELINE=1 in copies of the patched trees.
    assert sorted(p.name for p in out.iterdir()) == ["ab_logs.tar.gz", "ab_summary.txt"]
    with tarfile.open(out / "ab_logs.tar.gz") as archive:
        logs = {m.name.lstrip("./"): archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}
    assert "timeline=1" in logs["build_timeline_ab-test-good.log"]
    assert "moe_ep_timeline_ab-test-good" in logs["build_timeline_ab-test-good.log"]
    assert "timeline=0" in logs["build_ab-test-good.log"]
    assert pathlib.Path("/tmp/moe_ep_timeline_ab-test-good/AB_TEST_MARKER").read_text().strip() == "good"
    assert "1 failed" in logs["tests_ab-test-bad.log"] and "3 passed" in logs["tests_ab-test-good.log"]
