"""Every engine exit the supervisor did not ask for gets a named cause (exits.classify):
a pure function of the exit status, the last output, the phase and the OOM counters."""

from __future__ import annotations

import pytest

from appliance.engine import RestartReason as R
from appliance.supervisor.exits import child_death, classify, oom_moved

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


# Real vLLM on CPU under a squeezed memory cgroup (the chaos soak, #21 item 4): the
# kernel's OOM killer took the worker, the biggest process, not the API server; vLLM
# said so once, then printed its shutdown (far more than the 30-line tail) and exited 0.
WORKER_OOM = (
    "(EngineCore pid=28122) ERROR 11-26 04:04:00 [multiproc_executor.py:315] Worker proc "
    "VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor."
)
SHUTDOWN_NOISE = ['[engine1]  - leaked function "get_loc"'] * 30


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            WORKER_OOM,
            "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor.",
        ),
        (
            "(APIServer pid=1) WARNING 11-26 04:04:00 [core_client.py:817] [shutdown] MPClient: "
            "engine core exited unexpectedly; starting cleanup",
            "MPClient: engine core exited unexpectedly; starting cleanup",
        ),
        ("(APIServer pid=1) INFO 11-26 04:03:54 [loggers.py:335] Engine 000: Running: 5", None),
    ],
)
def test_vllm_words_for_a_process_of_its_tree_that_died(line: str, said: str | None) -> None:
    assert child_death(line) == said


def test_an_oom_kill_inside_the_engine_tree_is_named_oom_not_a_clean_exit() -> None:
    died = child_death(WORKER_OOM)
    cause = classify(0, SHUTDOWN_NOISE, False, True, died)
    assert cause.reason is R.OOM
    assert cause.words.startswith("exited with status 0 after a process of its tree died")
    assert "VllmWorker-0 died unexpectedly (exit code: -9)" in cause.words
    assert "likely killed by the kernel's OOM killer" in cause.words
    # No OOM kill counted: a process of its tree died, said as such, not "by itself".
    cause = classify(0, SHUTDOWN_NOISE, False, False, died)
    assert cause.reason is R.EXITED
    assert "after a process of its tree died" in cause.words
    # Nothing died under it: as before.
    assert classify(0, SHUTDOWN_NOISE, False, True).words == "exited by itself with status 0"
    # At start, a model that cannot load stays a load failure unless the OOM killer acted.
    load = ["(EngineCore) EngineCore failed to start.", LOAD]
    assert classify(1, load, True, False, died).reason is R.LOAD_FAILED
    assert classify(1, load, True, True, died).reason is R.OOM
