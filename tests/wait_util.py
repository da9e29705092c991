"""Polling for a condition in tests, with a deadline and a message that says what never happened."""

from __future__ import annotations

import time


def wait_for(pred, timeout_s: float = 10.0, what: str = "condition"):
    """``pred()``'s first truthy value, polled every 5 ms; AssertionError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
