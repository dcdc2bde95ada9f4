"""Overflow fallback: whether a request for model A goes to its fallback model B now.

A request for A goes to B only when none of A's engines can admit it *at once* and B can;
otherwise it queues for A as before (B full too: queueing for A is the better bet, A's
own engines will free up). One hop: B's own fallback is never considered, so the caller
passes B's room and nothing further. The client (``X-Appliance-Fallback: never``) or its
key (``keys create --no-fallback``) may refuse it; then ``allowed`` is False.

Why A cannot admit now is the reason label of ``appliance_fallbacks_total``:

- ``down``: no engine of A is READY (starting, restarting, drained, failed);
- ``heat``: every READY engine is at the hard thermal limit (admitted nothing new);
- ``kv``: every READY engine is behind the KV-cache breaker;
- ``full``: otherwise: READY engines at their in-flight or token budget (a mix of heat,
  KV and full budgets counts as full: what is left is a capacity problem).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FallbackReason = Literal["down", "heat", "kv", "full"]
REASONS: tuple[FallbackReason, ...] = ("down", "heat", "kv", "full")


@dataclass(frozen=True, slots=True)
class ModelRoom:
    """One model's engines at one moment, as the fallback decision sees them."""

    ready: int  # engines READY
    hot: int  # of those, at the hard thermal limit
    kv_tripped: int  # of those, behind the KV breaker
    can_admit: bool  # some engine has room for this request now (routing.has_room)


def why_not_now(room: ModelRoom) -> FallbackReason | None:
    """Why the model cannot admit the request at once, or None when it can."""
    if room.can_admit:
        return None
    if room.ready == 0:
        return "down"
    if room.hot == room.ready:
        return "heat"
    if room.kv_tripped == room.ready:
        return "kv"
    return "full"


def choose_fallback(
    primary: ModelRoom, fallback: ModelRoom | None, *, allowed: bool
) -> FallbackReason | None:
    """The reason to send this request to the fallback model now, or None: queue for the
    model it named (no fallback configured, refused, the model can admit, or the
    fallback cannot admit at once either)."""
    if not allowed or fallback is None:
        return None
    reason = why_not_now(primary)
    if reason is None or not fallback.can_admit:
        return None
    return reason
