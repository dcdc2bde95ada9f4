"""Every engine exit the supervisor did not ask for gets a named cause (exits.classify):
a pure function of the exit status, the last output, the phase and the OOM counters."""

from __future__ import annotations

import pytest

from appliance.engine import RestartReason as R
from appliance.supervisor.exits import classify, oom_moved

BIND = "ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8100)"
LOAD = "RuntimeError: Engine core initialization failed. See root cause above."


@pytest.mark.parametrize(
    ("code", "tail", "starting", "oom", "reason", "words"),
    [
        (3, ["INFO bye"], False, False, R.EXITED, "exited by itself with status 3"),
        (0, [], False, False, R.EXITED, "exited by itself with status 0"),
        (
            -9,
            [],
            False,
            False,
            R.SIGNAL,
            "killed by signal SIGKILL, which the supervisor did not send",
        ),
        (
            -11,
            [],
            False,
            True,
            R.SIGNAL,
            "killed by signal SIGSEGV, which the supervisor did not send",
        ),
        (-9, [], False, True, R.OOM, "killed by signal SIGKILL, likely the kernel's OOM killer"),
        (1, ["INFO x", BIND], True, False, R.BIND_FAILED, "failed to bind its address (status 1)"),
        (
            1,
            ["(EngineCore) EngineCore failed to start.", LOAD],
            True,
            False,
            R.LOAD_FAILED,
            "failed to load the model (status 1)",
        ),
        # Once serving, the same words are not a load failure: it exited, with its status.
        (1, [LOAD], False, False, R.EXITED, "exited by itself with status 1"),
        # The OOM killer at start shows as SIGKILL too: the signal wins over the words.
        (-9, [LOAD], True, True, R.OOM, "likely the kernel's OOM killer"),
    ],
)
def test_each_exit_has_a_named_cause(
    code: int, tail: list[str], starting: bool, oom: bool, reason: R, words: str
) -> None:
    cause = classify(code, tail, starting, oom)
    assert cause.reason is reason
    assert words in cause.words


@pytest.mark.parametrize(
    ("before", "after", "moved"),
    [
        ((0, 5), (1, 5), True),  # our cgroup's counter rose
        ((None, 5), (None, 6), True),  # no cgroup counter: the kernel's rose
        ((2, 5), (2, 5), False),
        ((None, None), (None, None), False),  # nothing readable: not an OOM kill
        ((None, 5), (3, 5), False),  # a counter that appeared is not a rise
    ],
)
def test_oom_counters(
    before: tuple[int | None, int | None], after: tuple[int | None, int | None], moved: bool
) -> None:
    assert oom_moved(before, after) is moved
