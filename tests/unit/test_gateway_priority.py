"""The gateway's CPU priority: taken where the system allows it, the current one kept where not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.priority import DEFAULT_NICE

AS_ROOT = os.geteuid() == 0
NOBODY = 65534


def nice_in_child(nice: int, start_at: int = 0, user: int | None = None) -> int:
    """The nice value the kernel reports for a fresh process started at ``start_at`` (as ``user``)
    once it has called ``raise_priority(nice)``."""
    code = (
        "import os; from gateway.priority import raise_priority;"
        f"os.setpriority(os.PRIO_PROCESS, 0, {start_at});"
        + ("" if user is None else f"os.setuid({user});")  # once the interpreter is in: it may not read it
        + f"raise_priority({nice}); print(os.getpriority(os.PRIO_PROCESS, 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out)


@pytest.mark.skipif(not AS_ROOT, reason="raising a priority needs root or CAP_SYS_NICE")
def test_the_default_is_taken_where_allowed() -> None:
    assert nice_in_child(DEFAULT_NICE) == DEFAULT_NICE


@pytest.mark.skipif(not AS_ROOT, reason="starts the child as another user")
def test_a_refused_priority_keeps_the_current_one() -> None:
    assert nice_in_child(DEFAULT_NICE, start_at=3, user=NOBODY) == 3


def test_a_value_above_the_current_one_is_left_alone() -> None:
    start = os.getpriority(os.PRIO_PROCESS, 0)
    assert nice_in_child(start + 2, start_at=start) == start
