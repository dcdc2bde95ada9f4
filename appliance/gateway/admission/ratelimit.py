"""Per-key rate limits: token buckets for requests per minute and tokens per minute.

A bucket holds up to one minute's allowance and refills continuously, so a key may
burst its whole minute at once and then runs at the steady rate. A refused request is
not charged, and the answer says how long until it would fit (``Retry-After``).
Tokens are charged up front from the estimate (prompt + max_tokens): the gateway cannot
know the real count before the engine has done the work. Once a request ends, the
engine's real count replaces the estimate (:meth:`RateLimiter.settle`): the estimate
guards admission, the key is debited what it used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class Bucket:
    rate_per_minute: float
    level: float
    stamp: float

    def _refill(self, now: float) -> None:
        self.level = min(
            self.rate_per_minute, self.level + (now - self.stamp) * self.rate_per_minute / 60.0
        )
        self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` fits (0 if it fits now). Charges nothing."""
        self._refill(now)
        need = min(amount, self.rate_per_minute) - self.level
        return 0.0 if need <= 0 else need * 60.0 / self.rate_per_minute


class RateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], Bucket] = {}

    def _bucket(self, key_id: str, kind: str, rate: int, now: float) -> Bucket:
        b = self._buckets.get((key_id, kind))
        if b is None or b.rate_per_minute != rate:
            b = Bucket(float(rate), float(rate), now)
            self._buckets[(key_id, kind)] = b
        return b

    def check(
        self, key_id: str, rpm: int | None, tpm: int | None, tokens: int, now: float | None = None
    ) -> tuple[str, float] | None:
        """None and both buckets charged, or (which limit, seconds to wait)."""
        now = time.monotonic() if now is None else now
        rb = self._bucket(key_id, "rpm", rpm, now) if rpm else None
        tb = self._bucket(key_id, "tpm", tpm, now) if tpm else None
        if rb is not None and (wait := rb.wait_for(1, now)) > 0:
            return "rpm", wait
        if tb is not None and (wait := tb.wait_for(tokens, now)) > 0:
            return "tpm", wait
        if rb is not None:
            rb.level -= 1
        if tb is not None:
            # A request bigger than a whole minute's allowance is let through on a full
            # bucket (and empties it) rather than refused forever.
            tb.level -= min(tokens, tb.rate_per_minute)
        return None

    def settle(
        self, key_id: str, tpm: int | None, estimate: int, used: int, now: float | None = None
    ) -> None:
        """Debit ``used`` tokens instead of the ``estimate`` charged at admission: the
        difference goes back to the bucket (or, past the estimate, is taken from it, which
        may leave it below zero: the key then waits until it has paid)."""
        b = self._buckets.get((key_id, "tpm")) if tpm else None
        if b is None or b.rate_per_minute != tpm:
            return  # no limit, or a new limit since admission: its bucket started afresh
        b._refill(time.monotonic() if now is None else now)
        charged = min(estimate, b.rate_per_minute)  # as check() charged it
        b.level = min(b.rate_per_minute, b.level + charged - used)

    def forget(self, live_key_ids: set[str]) -> None:
        """Drop buckets of revoked keys (called on keys reload)."""
        for k in [k for k in self._buckets if k[0] not in live_key_ids]:
            del self._buckets[k]
