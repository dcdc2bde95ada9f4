"""Engine owners for tests whose fake engines run in the test's own process."""

from __future__ import annotations

import os

from appliance.endpoint import EngineAddress, EngineOwner

IN_PROCESS = EngineOwner(pid=os.getpid, tree=lambda pid: {pid})


def in_process(address: EngineAddress) -> EngineOwner | None:
    """The owner of an engine served by this very process (its sockets are ours)."""
    return IN_PROCESS
