"""How an engine's failure travels through the relay, typed rather than in words.

An :class:`EngineFailure` is a failure before the first byte of the engine's answer
reached the client: the relay retries it on another engine, and when none is left the
client gets :func:`engine_error` (504 if the engine timed out, else 502). An
:class:`Attempt` is one try on one engine, kept so the supervisor's verdict on a hung
engine (``Relay.abandon``) can end the try at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.gateway.errors import GatewayError
from appliance.gateway.wire.http1 import UpstreamError

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Why an engine failed before the first byte of its answer reached the client.

    The relay retries it on another engine; when none is left, the client gets 504 if
    ``timed_out``, else 502, with ``reason`` in the message.
    """

    reason: str  # the words clients and logs see
    timed_out: bool  # the engine did not answer in time (not: refused, reset, 5xx, given up)
    # No answer at all: the connection was refused, its socket is gone, or it dropped
    # before a response head. The engine may have died a moment ago, before the
    # supervisor noticed: the relay waits for it to be back rather than answering 502.
    unanswered: bool = False

    @classmethod
    def of_client_error(cls, exc: BaseException, unanswered: bool = False) -> EngineFailure:
        """An aiohttp or socket error, named by its class. aiohttp's connect and read
        timeouts (``ServerTimeoutError`` and its kinds) are ``TimeoutError``s."""
        said = getattr(exc, "said", False)  # an error of ours, worded for the client
        reason = f"{type(exc).__name__}: {exc}" if said else type(exc).__name__
        timed_out = isinstance(exc, TimeoutError)
        return cls(reason, timed_out=timed_out, unanswered=unanswered and not timed_out)

    @classmethod
    def of_upstream(cls, exc: UpstreamError, unanswered: bool = False) -> EngineFailure:
        """A splice connection's failure, which says itself whether it timed out."""
        return cls(str(exc), timed_out=exc.timed_out, unanswered=unanswered and not exc.timed_out)

    @classmethod
    def engine_answered(cls, status: int) -> EngineFailure:
        """An engine's own 5xx: it answered, so it did not time out (even a 504)."""
        return cls(f"engine answered {status}", timed_out=False)


def engine_error(failure: EngineFailure) -> GatewayError:
    """No engine left to try: 504 when the last one timed out, 502 otherwise."""
    return GatewayError(
        504 if failure.timed_out else 502,
        f"the engine failed before answering ({failure.reason})",
        code="engine_error",
        reason="engine_error",
    )


@dataclass(eq=False, slots=True)
class Attempt:
    """One request's try on one engine, so the engine can be abandoned mid-try."""

    task: asyncio.Task[Any] | None
    # Closes the engine connection of this try (pending reads then fail), once there is one.
    close: Callable[[], None] | None = None
    given_up: EngineFailure | None = None  # set by abandon(): the engine stopped answering

    @property
    def why(self) -> str:
        """Why the engine was given up on; "" while it was not."""
        return self.given_up.reason if self.given_up is not None else ""


def failure_if_abandoned(attempt: Attempt) -> EngineFailure | None:
    """abandon()'s failure if the CancelledError being handled is abandon()'s own, and
    only that: then it is taken back and the try counts as an engine failure before the
    first byte (a client that went away cancels too, and that one must go on)."""
    task = asyncio.current_task()
    if attempt.given_up is None or task is None or task.uncancel() != 0:
        return None
    return attempt.given_up
