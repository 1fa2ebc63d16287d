"""moe_ep's benchmarks: `moe-ep-bench NAME [options]` or `python -m moe_ep.bench.NAME [options]`.

The figures in docs/BENCHMARKS.md and docs/DESIGN.md come from these, each with the command that made
it. `--help` on any of them lists its options; `moe-ep-bench` alone lists them all.
"""
