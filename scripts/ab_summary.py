"""A against B from two benchmark JSON-lines files (scripts/gpu_ab.sh): per problem, the median over
rounds of each variant and B's change in percent (positive: B is better)."""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Dict, List, Tuple

# (key of the problem, metric name, value, higher is better) for one JSON line.
Figure = Tuple[Tuple, str, float, bool]
LOW_LATENCY_TIMES = ("dispatch_us", "combine_us", "combine_zero_copy_us", "dispatch_graph_us", "combine_graph_us",
                     "combine_zero_copy_graph_us", "dispatch_zero_copy_us", "dispatch_zero_copy_graph_us")


def figures(row: dict) -> List[Figure]:
    if row.get("bench") == "intranode":
        key = ("intranode", row["ranks"], row["mode"], row.get("stream_combine", "auto"))
        return [(key, "GB/s per rank (mean)", statistics.mean(row["per_rank_gbps"]), True)]
    if row.get("bench") == "low_latency":
        key = ("low_latency", row["ranks"], f"{row['experts']} experts")
        worst = {name: max(r[name] for r in row["per_rank"]) for name in LOW_LATENCY_TIMES if name in row["per_rank"][0]}
        return [(key, f"{name} (worst rank)", value, False) for name, value in worst.items()]
    return []


def collect(path: str) -> Tuple[Dict[Tuple, List[float]], Dict[Tuple, bool]]:
    """Every figure of the file by problem and metric, and whether higher is better for it."""
    values: Dict[Tuple, List[float]] = defaultdict(list)
    higher: Dict[Tuple, bool] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                for key, metric, value, up in figures(json.loads(line)):
                    values[key + (metric,)].append(value)
                    higher[key + (metric,)] = up
    return values, higher


def label(key: Tuple) -> str:
    return " ".join(str(k) for k in key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("a", help="variant A's JSON lines")
    parser.add_argument("b", help="variant B's JSON lines")
    args = parser.parse_args()
    a, higher = collect(args.a)
    b, _ = collect(args.b)
    print(f"{'problem':<60} {'A (median)':>12} {'B (median)':>12} {'B vs A':>8}  runs")
    for key in sorted(set(a) & set(b), key=str):
        ma, mb = statistics.median(a[key]), statistics.median(b[key])
        gain = (mb / ma - 1) if higher[key] else (ma / mb - 1)
        print(f"{label(key):<60} {ma:>12.1f} {mb:>12.1f} {gain * 100:>+7.1f}%  {len(a[key])}/{len(b[key])}")
    for key in sorted(set(a) ^ set(b), key=str):
        side, values = ("A", a[key]) if key in a else ("B", b[key])
        print(f"{label(key):<60} only in {side}: {statistics.median(values):.1f} (median of {len(values)})")


if __name__ == "__main__":
    main()
