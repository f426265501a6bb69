"""Waiting for something to become true: one polling rule, in a blocking and an async flavour.

The rule: evaluate ``condition``; a truthy result ends the wait and is returned; past ``timeout``
seconds the wait fails with an AssertionError that names ``what`` it waited for (the blocking flavour
adds ``detail()``, a process log say, when given); otherwise sleep ``interval`` and evaluate again. The
condition is always evaluated at least once, and an exception it raises ends the wait with it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

INTERVAL_S = 0.02


class _Deadline:
    def __init__(self, timeout: float, what: str, detail: Callable[[], str] | None) -> None:
        self.end = time.monotonic() + timeout
        self.timeout, self.what, self.detail = timeout, what, detail

    def check(self) -> None:
        """Raises the wait's failure once the time is up."""
        if time.monotonic() > self.end:
            message = f"timed out after {self.timeout:g} s waiting for {self.what}"
            raise AssertionError(message + (f":\n{self.detail()}" if self.detail else ""))


def wait_until(
    condition: Callable[[], T],
    what: str,
    *,
    timeout: float = 10,
    interval: float = INTERVAL_S,
    detail: Callable[[], str] | None = None,
) -> T:
    """Blocks until ``condition()`` is truthy and returns that value (the rule above)."""
    deadline = _Deadline(timeout, what, detail)
    while not (result := condition()):
        deadline.check()
        time.sleep(interval)
    return result


async def wait_until_async(
    condition: Callable[[], T | Awaitable[T]], what: str, *, timeout: float = 10, interval: float = INTERVAL_S
) -> T:
    """Like ``wait_until``, sleeping on the event loop; ``condition`` may return an awaitable."""
    deadline = _Deadline(timeout, what, None)
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        deadline.check()
        await asyncio.sleep(interval)
