"""A short C++ program compiled against csrc/kernels' headers for the host (those free of CUDA, or made so
by defining __host__ and __device__ away), run, and its output read as one JSON object a line: so that a
formula the kernels share with Python, or a rule they apply, is tested on any machine with a compiler."""
import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILER = shutil.which("g++") or shutil.which("c++")


def run_against_headers(folder, name: str, source: str) -> list:
    """Compiles `source` in `folder` (a pytest tmp path) and runs it -> its output lines as JSON objects."""
    if COMPILER is None:
        pytest.skip("no C++ compiler")
    program, binary = folder / f"{name}.cpp", folder / name
    program.write_text(source)
    subprocess.run([COMPILER, "-std=c++17", "-I", os.path.join(ROOT, "csrc", "kernels"), str(program), "-o", str(binary)],
                   check=True)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in output.splitlines()]


# Prints every table the extension exports (kReportTables), one JSON object a line.
REPORTS_PROGRAM = r"""
#include <cstdio>
#include "reports.cuh"
int main() {
    for (const moe_ep::NamedTable& table : moe_ep::kReportTables) {
        std::printf("{\"table\": \"%s\", \"values\": {", table.name);
        for (int i = 0; i < table.size; ++i)
            std::printf("%s\"%s\": %d", i ? ", " : "", table.values[i].name, table.values[i].value);
        std::printf("}}\n");
    }
    return 0;
}
"""


def report_tables(folder) -> dict:
    """{table: {name: value}} as the extension exports them, from csrc/kernels/reports.cuh compiled for the
    host (its static_asserts hold, or this fails to compile)."""
    lines = run_against_headers(folder, "reports", REPORTS_PROGRAM)
    return {line["table"]: line["values"] for line in lines}
