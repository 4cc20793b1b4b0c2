"""The retry budget: retries may add at most `ratio` of recent traffic (plus a small floor), so a
failing fleet cannot multiply its own load through retries."""
from __future__ import annotations

import time

from proxy.config import RetryConfig


class RetryBudget:
    def __init__(self, config: RetryConfig, cap: float = 100.0) -> None:
        self.ratio = config.budget_ratio
        self.floor = config.budget_min_per_s
        self.max_attempts = config.max_attempts
        self.cap = cap
        self.tokens = min(cap, max(self.floor, 1.0))
        self.last = time.monotonic()

    def deposit(self) -> None:
        """One request was served: it earns `ratio` of a retry."""
        self.tokens = min(self.cap, self.tokens + self.ratio)

    def withdraw(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.cap, self.tokens + (now - self.last) * self.floor)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
