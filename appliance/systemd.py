"""Talking to systemd: the ``sd_notify`` protocol, without libsystemd.

The protocol
------------
A service started with ``Type=notify`` finds ``NOTIFY_SOCKET`` in its environment:
the address of an ``AF_UNIX`` datagram socket owned by the service manager. It is a
file path, or, when it starts with ``@``, a name in the Linux abstract namespace (the
``@`` stands for a leading NUL byte). Each datagram holds newline-separated
``KEY=VALUE`` assignments; the ones this daemon sends:

``READY=1``
    Start-up is done. ``systemctl start`` returns only now, so it is sent once the
    gateway accepts requests and every engine has settled, READY or FAILED (loading is
    over; ``/readyz`` says whether one serves), not when the process merely runs. See
    :mod:`appliance.supervisor.notify` for when each message is sent.
``STATUS=<one line>``
    Free text shown by ``systemctl status``.
``EXTEND_TIMEOUT_USEC=<µs>``
    "Give me this much longer" while starting (models take minutes to load) or
    stopping (draining in-flight work); it moves the deadline, it does not add up.
``WATCHDOG=1``
    The keep-alive. With ``WatchdogSec=`` set, systemd passes ``WATCHDOG_USEC`` (and
    ``WATCHDOG_PID``, the process meant to ping) and kills and restarts the service
    when no ping arrives within that time.
``RELOADING=1`` + ``MONOTONIC_USEC=<µs>``
    A reload (SIGHUP) has begun; ``READY=1`` ends it. systemd >= 253 requires the
    ``CLOCK_MONOTONIC`` timestamp with ``Type=notify-reload``; older ones and
    ``Type=notify`` ignore it.
``STOPPING=1``
    Shutdown has begun; ``EXTEND_TIMEOUT_USEC`` follows at once and then every few
    seconds while the drain and the engines' stop go on.

Where the watchdog ping comes from
----------------------------------
:class:`Notifier` never pings by itself, and must not be driven by a thread or a
timer of its own: those keep ticking while the event loop is stuck, which is exactly
the failure the watchdog exists to catch. The caller pings from the main loop's own
periodic tick (the supervisor's housekeeping step), at least every
:attr:`Notifier.watchdog_interval_s` (half of ``WATCHDOG_USEC``, as ``sd_watchdog_enabled``
advises), and only while that tick is doing its work. A wedged loop then stops the
pings and systemd restarts the service.

Failure policy
--------------
Without ``NOTIFY_SOCKET`` (a developer's shell, a test) every call is a silent no-op.
A failed send never raises: the daemon must not die because the manager went away or
its socket is full. The first failure of an outage is logged at WARNING, later ones at
DEBUG until a send succeeds again.

Children
--------
Engines must not talk to systemd as if they were the service (``NotifyAccess=main``
would drop it anyway, and a stray ``READY=1`` or ``STOPPING=1`` would lie), nor adopt
sockets meant for us: build their environment with :func:`child_environment`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Self

__all__ = ["CHILD_ENV_DENYLIST", "Notifier", "child_environment"]

log = logging.getLogger(__name__)

CHILD_ENV_DENYLIST: frozenset[str] = frozenset(
    {
        # sd_notify: a child could declare the service ready, stopping or alive.
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        # Socket activation (sd_listen_fds): these describe fds that are ours.
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
    }
)
"""Variables removed from every child's environment.

``INVOCATION_ID`` is kept on purpose: it only names this run of the service (useful to
correlate engine logs) and opens no channel to systemd.
"""

# A blocked send (the manager's queue is full, the manager is hung) must not stall
# the event loop for long; give up after this and count it as a failed send.
_SEND_TIMEOUT_S = 0.5


def child_environment(base: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``base`` without :data:`CHILD_ENV_DENYLIST`, for a child process."""
    return {key: value for key, value in base.items() if key not in CHILD_ENV_DENYLIST}


def _socket_address(notify_socket: str) -> str | None:
    """The ``AF_UNIX`` address for ``NOTIFY_SOCKET``, or None when unsupported."""
    if notify_socket.startswith("@") and len(notify_socket) > 1:
        return "\0" + notify_socket[1:]
    if notify_socket.startswith("/"):
        return notify_socket
    # Relative paths are invalid; "vsock:" (systemd >= 254, VMs) is not ours to handle.
    return None


def _parse_positive_int(name: str, raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, raw)
        return None
    if value <= 0:
        log.warning("ignoring %s=%r: not positive", name, raw)
        return None
    return value


class Notifier:
    """Sends ``sd_notify`` messages to the service manager; a no-op when not under one.

    Build it with :meth:`from_env`. One datagram socket is opened on the first send and
    kept until :meth:`close`. Thread-safe, though it is meant for the event loop.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        """``address`` as for ``socket.sendto`` (abstract names start with NUL)."""
        self._address = address
        self._watchdog_usec = watchdog_usec if address is not None else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (default: os.environ).

        The watchdog applies only when ``WATCHDOG_PID`` is absent or names this process.
        The environment is not modified; strip it from children with
        :func:`child_environment`.
        """
        env = os.environ if env is None else env
        raw_socket = env.get("NOTIFY_SOCKET", "")
        if not raw_socket:
            return cls(None)
        address = _socket_address(raw_socket)
        if address is None:
            log.warning("NOTIFY_SOCKET=%r is not supported; not notifying systemd", raw_socket)
            return cls(None)

        watchdog_usec = _parse_positive_int("WATCHDOG_USEC", env.get("WATCHDOG_USEC"))
        watchdog_pid = env.get("WATCHDOG_PID")
        if watchdog_usec is not None and watchdog_pid:
            pid = _parse_positive_int("WATCHDOG_PID", watchdog_pid)
            if pid != os.getpid():
                log.debug("WATCHDOG_PID=%s is not us (%d): no watchdog", watchdog_pid, os.getpid())
                watchdog_usec = None
        return cls(address, watchdog_usec)

    @property
    def enabled(self) -> bool:
        """True when there is a service manager to talk to."""
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to call :meth:`watchdog` (half of ``WATCHDOG_USEC``); None: no watchdog."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    # -- the messages -----------------------------------------------------------------

    def ready(self) -> bool:
        """``READY=1``: start-up (or a reload) is complete."""
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        """``STATUS=``: one line for ``systemctl status``; line breaks become spaces."""
        one_line = " ".join(part.strip() for part in text.splitlines() if part.strip())
        return self.notify(f"STATUS={one_line}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1``, when the watchdog is on. Call it from the main loop's tick."""
        if self._watchdog_usec is None:
            return False
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        """``STOPPING=1``: shutdown has begun."""
        return self.notify("STOPPING=1")

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC``; finish the reload with :meth:`ready`."""
        monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec}")

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC=``: the current start/stop deadline is now ``seconds`` away."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"extend_timeout needs a finite, non-negative time, not {seconds!r}")
        return self.notify(f"EXTEND_TIMEOUT_USEC={math.ceil(seconds * 1_000_000)}")

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram. True when sent; False when disabled or failed.

        Each line is one ``KEY=VALUE`` assignment and must not contain a newline.
        """
        for line in lines:
            if "\n" in line or "=" not in line:
                raise ValueError(f"not a single KEY=VALUE line: {line!r}")
        if self._address is None or not lines:
            return False
        payload = "\n".join(lines).encode("utf-8")
        with self._lock:
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    sock.settimeout(_SEND_TIMEOUT_S)
                    self._sock = sock
                self._sock.sendto(payload, self._address)
            except OSError as exc:
                level = logging.DEBUG if self._failing else logging.WARNING
                self._failing = True
                log.log(level, "could not notify systemd (%s): %s", lines[0], exc)
                return False
            if self._failing:
                log.info("notifying systemd works again")
                self._failing = False
            return True

    def close(self) -> None:
        """Close the socket; a later send opens a new one."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Notifier(enabled={self.enabled}, watchdog_interval_s={self.watchdog_interval_s})"
