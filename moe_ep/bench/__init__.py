"""moe_ep's benchmarks: `moe-ep-bench NAME [options]` or `python -m moe_ep.bench.NAME [options]`; on
torchrun's ranks, `torchrun ... -m moe_ep.bench NAME [options]` (moe_ep/bench/torchrun.py).

The figures in docs/BENCHMARKS.md and docs/DESIGN.md come from these, each with the command that made
it. `--help` on any of them lists its options; `moe-ep-bench` alone lists them all.
"""


def command_name(spec) -> str:
    """What benchmark module `spec` calls itself in its --help: `moe-ep-bench NAME` (argparse would name
    the file)."""
    return f"moe-ep-bench {spec.name.rsplit('.', 1)[-1]}"
