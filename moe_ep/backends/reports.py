"""The tables of csrc/kernels/reports.cuh read in Python, for where no extension is built: the tools and
tests that run the Python layer with the kernels stubbed get the same {name: value} dicts the extension
exports (csrc/bindings.cpp), from the one definition the kernels compile. The reader knows only the forms
that header uses (enumerators with an integer or `other + n` value, or none, and the name tables);
anything else raises, and tests/test_progress_marks.py checks its result against the header compiled
for the host and against a built extension."""

from __future__ import annotations

import os
import re
import types
from typing import Dict

# Where the header lies in a source checkout (the package is installed editable, or run from the tree).
HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc",
                      "kernels", "reports.cuh")

_ENUM = re.compile(r"\benum\s+(\w+)\s*:\s*int\s*\{(.*?)\}\s*;", re.S)
_NAMES = re.compile(r"\bconstexpr\s+NamedValue\s+(\w+)\s*\[\]\s*=\s*\{(.*?)\}\s*;", re.S)
_NAMED = re.compile(r'\{\s*"(\w+)"\s*,\s*(?:\w+::)*(\w+)\s*\}')
_EXPORTED = re.compile(r'\bnamed_table\(\s*"(\w+)"\s*,\s*(\w+)\s*\)')
_LITERAL = re.compile(r"\d+|0[xX][0-9a-fA-F]+")


def _value(expression: str, known: Dict[str, int]) -> int:
    """An enumerator's value as the header writes it: integers and earlier enumerators added up."""
    parts = re.split(r"([+-])", re.sub(r"\s+", "", expression))
    total, sign = 0, 1
    for i, part in enumerate(parts):
        if i % 2:
            sign = -1 if part == "-" else 1
        elif _LITERAL.fullmatch(part):
            total += sign * int(part, 0)
        elif part in known:
            total += sign * known[part]
        elif part or i != 0 or len(parts) == 1:  # only a leading sign leaves an empty part
            raise ValueError(f"{HEADER}: cannot read the enumerator value {expression.strip()!r}")
    return total


def parse(text: str) -> Dict[str, Dict[str, int]]:
    """{exported table: {name: value}} of a reports.cuh text: every enum's enumerators valued as C++
    does, looked up by each name table, under the names kReportTables exports them by."""
    text = re.sub(r"//[^\n]*", "", text)
    values: Dict[str, int] = {}
    for _, body in _ENUM.findall(text):
        following = 0
        for entry in filter(None, (entry.strip() for entry in body.split(","))):
            name, _, expression = (part.strip() for part in entry.partition("="))
            following = _value(expression, values) if expression else following
            if name in values:
                raise ValueError(f"{HEADER}: {name} is defined twice")
            values[name] = following
            following += 1
    tables = {name: {key: values[enumerator] for key, enumerator in _NAMED.findall(body)}
              for name, body in _NAMES.findall(text)}
    exported = _EXPORTED.findall(text)
    if not exported:
        raise ValueError(f"{HEADER}: no kReportTables entries found")
    return {table: tables[array] for table, array in exported}


def read_header(path: str = HEADER) -> types.SimpleNamespace:
    """The exported tables as attributes (HOST_INFO, KERNEL_IDS, ...), as moe_ep._C holds them."""
    try:
        with open(path) as header:
            text = header.read()
    except OSError as exc:
        raise RuntimeError(f"moe_ep: neither the extension nor csrc/kernels/reports.cuh is at hand to number the "
                           f"kernels' reports by ({exc}); run from a source checkout or build the extension") from exc
    return types.SimpleNamespace(**parse(text))
