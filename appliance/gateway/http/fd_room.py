"""Room for the gateway's connections in the process's open-files limit."""

from __future__ import annotations

import resource

from appliance.gateway.http.server import MAX_LINGERING

# File descriptors the daemon needs besides client connections (engines, pipes, files).
FD_HEADROOM = 256


def ensure_fd_room(max_connections: int) -> str | None:
    """Raise the soft open-files limit to fit max_connections, up to the hard limit.

    Outside systemd (whose unit sets LimitNOFILE) the soft limit is often 1024, below the
    default cap: connections past it would fail in accept() instead of getting a 503.
    Returns a warning when the hard limit is too low, else None.
    """
    need = max_connections + MAX_LINGERING + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            target = soft
    if target >= need:
        return None
    return (
        f"gateway.max_connections = {max_connections} but this process may open only "
        f"{target} files (ulimit -n; hard limit {hard}): connections beyond about "
        f"{max(target - MAX_LINGERING - FD_HEADROOM, 0)} will fail; raise LimitNOFILE or lower "
        "gateway.max_connections"
    )
