"""The engine benchmark's worker: ``python -m loadtests.bench_engine.worker TASK_JSON`` runs one
(engine, dtype) group in a fresh interpreter and writes its measurements to the task's result
file (stdout may carry library chatter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from loadtests.bench_engine.groups import GROUPS
from loadtests.bench_engine.settings import Settings


def worker(task: dict[str, Any]) -> None:
    settings = Settings(**task["settings"])
    result = GROUPS[task["engine"]](settings, task["dtype"])
    Path(task["result_path"]).write_text(json.dumps(result))


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
