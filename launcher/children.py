"""Child processes that never outlive the process that started them.

A supervisor (``kvroute up``) that is killed outright, or whose terminal closes, must not leave
Redis, replicas and a gateway behind holding their ports. On Linux each child asks the kernel for
SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, set between fork and exec); elsewhere
only an orderly stop reaches them. Children also get a session of their own, so a Ctrl-C in the
terminal reaches the supervisor alone, which then stops them in order.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1


def _death_signal_setter() -> Callable[[], None] | None:
    """A pre-exec hook for Linux, resolved once here: the hook itself runs in the forked child,
    where it must not import or look anything up."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return die_with_parent


def spawn(args: list[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(args, ...)`` in a new session, terminated when this process dies.

    Linux ties the death signal to the spawning *thread*: spawn from a thread that lives as long
    as the child (the main thread, for a supervisor).
    """
    return subprocess.Popen(args, start_new_session=True, preexec_fn=_death_signal_setter(), **popen_kwargs)
