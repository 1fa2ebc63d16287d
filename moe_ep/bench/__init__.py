"""moe_ep's benchmarks: `moe-ep-bench NAME [options]` or `python -m moe_ep.bench.NAME [options]`.

Every figure in docs/PERFORMANCE.md comes from one of these, with the command that made it. `--help` on
any of them lists its options; `moe-ep-bench` alone lists them all.
"""
