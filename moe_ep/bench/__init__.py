"""moe_ep's benchmarks: `moe-ep-bench NAME [options]` or `python -m moe_ep.bench.NAME [options]`; on
torchrun's ranks, `torchrun ... -m moe_ep.bench NAME [options]` (moe_ep/bench/torchrun.py).

The figures in docs/BENCHMARKS.md and docs/DESIGN.md come from these, each with the command that made
it. `--help` on any of them lists its options; `moe-ep-bench` alone lists them all.
"""

import argparse


def command_parser(spec, description: str) -> argparse.ArgumentParser:
    """Benchmark module `spec`'s command line: `moe-ep-bench NAME` in its --help (argparse would name the
    file), its description printed as written."""
    return argparse.ArgumentParser(prog=f"moe-ep-bench {spec.name.rsplit('.', 1)[-1]}", description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
