import collections
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_ep.launch import DEFAULT_CALL_TIMEOUT_S, RankPool  # noqa: E402

# The tests see the built-in configs, not a cache `moe-ep-bench tune` wrote on this machine (set the
# variable to run them against one); the ranks the tests start inherit this.
os.environ.setdefault("MOE_EP_CONFIG_CACHE", "")

# MOE_EP_TEST_CALL_TIMEOUT_S shortens every pool call, for GPU runs on a machine lent for minutes.
CALL_TIMEOUT_S = float(os.environ.get("MOE_EP_TEST_CALL_TIMEOUT_S", DEFAULT_CALL_TIMEOUT_S))


@pytest.fixture(scope="session")
def pools():
    """pools(n): a RankPool of n CPU ranks over gloo, started on first use and kept for the session."""
    started = {}

    def get(num_ranks: int) -> RankPool:
        if num_ranks not in started or not started[num_ranks].alive:
            started[num_ranks] = RankPool(num_ranks, call_timeout_s=CALL_TIMEOUT_S)
        return started[num_ranks]

    yield get
    for pool in started.values():
        pool.close()


@pytest.fixture(scope="session")
def gpu_pools():
    """gpu_pools(n): n ranks with CUDA tensors, all on the visible GPUs (under a private MPS daemon
    when they share one), gloo for the host side where NCCL cannot serve."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    started = {}

    def get(num_ranks: int) -> RankPool:
        if num_ranks not in started or not started[num_ranks].alive:
            started[num_ranks] = RankPool(num_ranks, use_cuda=True, backend="gloo",
                                          env={"MOE_EP_TEST_CUDA": "1"}, call_timeout_s=CALL_TIMEOUT_S)
        return started[num_ranks]

    yield get
    for pool in started.values():
        pool.close()


@pytest.fixture(scope="session")
def report_tables():
    """{table: {name: value}}: the kernels' report numbers (csrc/kernels/reports.cuh) as the extension
    exports them, read from the header in Python (tests/test_progress_marks.py checks that reading)."""
    from moe_ep.backends.reports import read_header

    return vars(read_header())


@pytest.fixture
def kernel_enums(report_tables):
    """moe_ep.backends.peers.KernelEnums over the header's tables: the numbers the Python that reads the
    kernels' reports gets from the extension, on a machine without it."""
    import types

    from moe_ep.backends.peers import KernelEnums

    return KernelEnums(types.SimpleNamespace(**report_tables))


@pytest.fixture
def seed(request):
    """A fresh seed per test (MOE_EP_TEST_SEED pins it); shown in the report so a failure can be replayed."""
    value = int(os.environ.get("MOE_EP_TEST_SEED", random.SystemRandom().randrange(2**31)))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value}")
    return value


def pytest_terminal_summary(terminalreporter):
    """One line per reason a test was skipped, with how many it skipped (pytest's -rs writes a line per
    place, hundreds where the GPU tests skip on a CPU machine)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter(_skip_reason(report) for report in skipped)
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:>5}  {reason}")


def _skip_reason(report) -> str:
    """A skip's reason without its place: the longrepr of a skip is (path, line, "Skipped: reason")."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
