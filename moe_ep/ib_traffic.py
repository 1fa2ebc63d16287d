"""The InfiniBand service level and RoCE traffic class of NVSHMEM's traffic between nodes, so a fabric's QoS
can keep the expert-parallel traffic apart from other jobs' (or from NCCL's, which has NCCL_IB_SL /
NCCL_IB_TC).

NVSHMEM reads NVSHMEM_IB_SL (0-15) and NVSHMEM_IB_TRAFFIC_CLASS (0-255) once, when it starts (at a
Buffer's first call that needs it). A value comes from the Buffer's argument (`ib_service_level=`,
`ib_traffic_class=`), else from MOE_EP_IB_SL / MOE_EP_IB_TRAFFIC_CLASS; the Buffer sets the NVSHMEM
variable from it at construction. An NVSHMEM variable already in the environment with another value (set
by hand, or by an earlier Buffer once NVSHMEM has started) is an error, never overridden; alone it is left
for NVSHMEM to read. A value given once NVSHMEM has started without its variable is an error too (it
would never be read). Every rank's resulting values must agree (the construction compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, MutableMapping, Optional


@dataclass(frozen=True)
class Setting:
    argument: str  # the Buffer's keyword
    variable: str  # moe_ep's environment variable
    nvshmem_variable: str  # what NVSHMEM reads
    maximum: int


SETTINGS = (
    Setting("ib_service_level", "MOE_EP_IB_SL", "NVSHMEM_IB_SL", 15),  # an InfiniBand SL is 4 bits
    Setting("ib_traffic_class", "MOE_EP_IB_TRAFFIC_CLASS", "NVSHMEM_IB_TRAFFIC_CLASS", 255),  # the GRH's 8 bits
)

# The NVSHMEM variables a Buffer of this process set, and their values: those it may set again before
# NVSHMEM starts (a later Buffer's own values), unlike ones found in the environment.
_set_here: Dict[str, str] = {}


def _checked(name: str, value, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int from 0 to {maximum}, got {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{name}: expected an int from 0 to {maximum}, got {value}")
    return value


def _from_environment(name: str, environ: MutableMapping[str, str], maximum: int) -> Optional[int]:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) > maximum:  # isdigit alone takes other scripts' digits
        raise ValueError(f"{name}: expected an int from 0 to {maximum}, got {raw!r}")
    return int(raw)


def resolve(arguments: Dict[str, Optional[int]], environ: MutableMapping[str, str], nvshmem_started: bool
            ) -> Dict[str, int]:
    """The Buffer's arguments (None: not given) and the environment -> {NVSHMEM variable: value} that NVSHMEM
    will read (values found in the environment included). Raises naming the argument or variable that is
    out of range or conflicts; changes nothing."""
    effective = {}
    for setting in SETTINGS:
        given = arguments.get(setting.argument)
        if given is not None:
            value, source = _checked(setting.argument, given, setting.maximum), f"{setting.argument}={given}"
        else:
            value = _from_environment(setting.variable, environ, setting.maximum)
            source = f"{setting.variable}={value}"
        present = _from_environment(setting.nvshmem_variable, environ, setting.maximum)
        if value is None:
            if present is not None:
                effective[setting.nvshmem_variable] = present
            continue
        if present is None and nvshmem_started:  # NVSHMEM read no value when it started: too late to set one
            raise ValueError(f"{source}: NVSHMEM has started in this process without {setting.nvshmem_variable} "
                             "and reads it only when it starts; set it before the first Buffer that starts NVSHMEM")
        ours = _set_here.get(setting.nvshmem_variable) == environ.get(setting.nvshmem_variable)
        if present is not None and present != value and (nvshmem_started or not ours):
            why = ("NVSHMEM has started with it in this process" if nvshmem_started and ours
                   else "an explicit setting is not overridden")
            raise ValueError(f"{source} conflicts with {setting.nvshmem_variable}={present} in the environment "
                             f"({why}); unset one of them or make them equal")
        effective[setting.nvshmem_variable] = value
    return effective


def apply(effective: Dict[str, int], environ: MutableMapping[str, str]) -> None:
    """Puts resolve()'s values where NVSHMEM reads them (before it starts; equal values change nothing)."""
    for variable, value in effective.items():
        present = environ.get(variable, "").strip()
        # An equal value spelled otherwise ("07") is the user's: left as it is, and never ours to change.
        if not (present.isascii() and present.isdigit() and int(present) == value):
            environ[variable] = str(value)
            _set_here[variable] = str(value)


def nvshmem_started() -> bool:
    from .backends import peers

    return peers.nvshmem_world() is not None
