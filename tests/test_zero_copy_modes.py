"""set_zero_copy: each name's switches, a bad name refused (CPU only, no megatron-core needed)."""

import os

import pytest

from moe_ep.zero_copy_modes import ZERO_COPY_CHOICES, set_zero_copy

SWITCHES = ("MOE_EP_ZERO_COPY_DISPATCH", "MOE_EP_ZERO_COPY_COMBINE", "MOE_EP_DISPATCH_ARENA")


# The switches each choice turns on, in the order of SWITCHES.
EXPECTED = {"none": "000", "dispatch": "100", "combine": "010", "both": "110", "arena": "001"}


@pytest.mark.parametrize("which, expected", EXPECTED.items())
def test_each_choice_sets_its_switches(which, expected, monkeypatch):
    for name in SWITCHES:
        monkeypatch.setenv(name, "unset")
    set_zero_copy(which)
    assert "".join(os.environ[name] for name in SWITCHES) == expected


def test_every_choice_is_checked_above():
    assert set(ZERO_COPY_CHOICES) == set(EXPECTED)


def test_a_bad_name_is_refused_and_changes_nothing(monkeypatch):
    for name in SWITCHES:
        monkeypatch.setenv(name, "kept")
    with pytest.raises(ValueError, match="zero copy: expected one of .*'all'"):
        set_zero_copy("all")
    assert all(os.environ[name] == "kept" for name in SWITCHES)
