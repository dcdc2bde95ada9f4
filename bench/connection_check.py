"""What checking a new TCP engine connection costs (engine.listen = "tcp" only).

``python -m bench.connection_check [--sockets N] [--rounds N]``: a listener in this
process plays the engine (its pid is the owner) and N other loopback connections held
here stand for a busy engine's (2N fds to read in a full check). Each round times
:meth:`EngineOwner.refusal`: "cold", the first connection of an engine (its fds are
read to find its listener); then, the listener remembered, a later connection while it
waits in the accept queue ("queued") and after the accept ("accepted"). Prints
microseconds per check; no bound is asserted. Unix-socket engines run none of this.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

from appliance.endpoint import EngineOwner


def _time_us(owner: EngineOwner, local: tuple[str, int], port: int, since: float) -> float:
    start = time.perf_counter()
    owner.refusal(local, port, since)
    return (time.perf_counter() - start) * 1e6


def _crowd(n: int) -> list[socket.socket]:
    """``n`` established loopback connections (both ends: 2n lines in /proc/net/tcp)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(n + 1)
    ends = [server]
    for _ in range(n):
        ends.append(socket.create_connection(server.getsockname()))
        ends.append(server.accept()[0])
    return ends


def run(sockets: int, rounds: int) -> dict[str, list[float]]:
    crowd = _crowd(sockets)  # held by this process, as an engine holds its connections
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(rounds + 1)
    port = listener.getsockname()[1]
    times: dict[str, list[float]] = {"cold": [], "queued": [], "accepted": []}
    try:
        for _ in range(rounds):
            # A fresh owner: the engine's fds are read (its first connection after a spawn).
            cold = EngineOwner(pid=os.getpid, tree=lambda pid: {pid})
            warm = EngineOwner(pid=os.getpid, tree=lambda pid: {pid})
            with socket.create_connection(("127.0.0.1", port)) as first:
                where = first.getsockname()
                times["cold"].append(_time_us(cold, where, port, 0.0))
                assert warm.refusal(where, port) is None  # remembers the listener
                listener.accept()[0].close()
            since = time.monotonic()
            with socket.create_connection(("127.0.0.1", port)) as conn:
                local = conn.getsockname()
                times["queued"].append(_time_us(warm, local, port, since))
                accepted, _ = listener.accept()
                with accepted:
                    times["accepted"].append(_time_us(warm, local, port, since))
                    assert warm.refusal(local, port, since) is None
    finally:
        listener.close()
        for s in crowd:
            s.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sockets", type=int, default=200, help="other loopback connections")
    p.add_argument("--rounds", type=int, default=500)
    args = p.parse_args()
    times = run(args.sockets, args.rounds)
    fds = len(os.listdir(f"/proc/{os.getpid()}/fd"))
    print(f"one check of a new connection ({args.sockets} other connections; {fds} fds now):")
    for case, values in times.items():
        values.sort()
        p95 = values[int(len(values) * 0.95)]
        print(f"  {case:9} median {statistics.median(values):7.1f} us   p95 {p95:7.1f} us")


if __name__ == "__main__":
    main()
