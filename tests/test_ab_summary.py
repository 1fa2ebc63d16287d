"""scripts/ab_summary.py: medians per problem and B's change, in the direction each metric improves."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _intranode(gbps):
    return {"bench": "intranode", "ranks": 4, "mode": "combine", "stream_combine": "auto", "per_rank_gbps": gbps}


def _low_latency(dispatch_us):
    return {"bench": "low_latency", "ranks": 8, "experts": 256,
            "per_rank": [{"dispatch_us": us, "combine_us": 100.0} for us in dispatch_us]}


def test_medians_and_gains(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_intranode([100, 100]), _intranode([90, 110]), _intranode([50, 50]),
                                      _low_latency([100.0, 120.0])])
    b = _write(tmp_path / "b.jsonl", [_intranode([120, 120]), _intranode([110, 130]), _intranode([10, 10]),
                                      _low_latency([90.0, 96.0])])
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_summary.py"), a, b], check=True,
                         capture_output=True, text=True).stdout
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    combine = lines["intranode 4 combine auto GB/s per rank (mean)"]
    assert "100.0" in combine and "120.0" in combine and "+20.0%" in combine and "3/3" in combine, combine
    dispatch = lines["low_latency 8 256 experts dispatch_us (worst rank)"]  # time: lower is better
    assert "120.0" in dispatch and "96.0" in dispatch and "+25.0%" in dispatch, dispatch
    assert "+0.0%" in lines["low_latency 8 256 experts combine_us (worst rank)"]
