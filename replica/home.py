"""Where kvroute keeps what it makes once and reuses: converted models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def kvroute_home() -> Path:
    """Root of kvroute's caches: ``$KVROUTE_HOME``, else ``~/.cache/kvroute``."""
    return Path(os.environ.get("KVROUTE_HOME") or Path.home() / ".cache" / "kvroute").expanduser()
