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
