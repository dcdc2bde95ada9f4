"""Models on demand on the real driver: two models take turns on GPU 0, each holding
more than half of its memory, so the second can only allocate once the first's is really
back. With ``swap = "stop"`` (the "swap" line) the supervisor must see the first model's
memory freed in NVML before the second one loads (on a GPU an orphaned EngineCore can
hold it for seconds after its API server exits: vllm#55510); with ``swap = "sleep"``
(the "sleep" line) the first is put to sleep (the stand-in's EngineCore frees its memory
before ``/sleep`` answers, as vLLM's does) and the other loads or wakes once it is back.
Both answer. Each mode its own daemon, after the first one's cleanup: the main config
has one model always on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.gpu_check.checks import SHOWN_SHARE, engine_tree
from tests.gpu_check.daemon import REPO, CheckFailed, Daemon, base_config, daemon_env
from tests.gpu_check.lifecycle import STAMP_SLACK_S, ours_alive
from tests.gpu_check.nvml_view import GpuSample, NvmlView
from tests.gpu_check.report import Line, gib

# Two of these cannot fit on one GPU: a start before the memory is back fails to allocate.
SWAP_SHARE = 0.55


@dataclass(frozen=True)
class SwapRun:
    """What the swap phase needs from the main run."""

    work: Path
    python: str
    engine_env: dict[str, str]
    fake_dir: Path | None
    run_id: str
    view: NvmlView
    release_timeout_s: float
    mode: str = "stop"  # the models' swap: "stop" or "sleep"

    @property
    def models(self) -> tuple[str, str]:
        prefix = "swap" if self.mode == "stop" else "sleep"
        return f"{prefix}-a", f"{prefix}-b"

    @property
    def line(self) -> str:
        return "swap" if self.mode == "stop" else "sleep"


def swap_config(work: Path, run: SwapRun) -> dict[str, Any]:
    cfg = base_config(work, run.python, SWAP_SHARE, run.engine_env)
    del cfg["engine"]["served_model_name"]
    on_demand = {"load": "on_demand", "swap": run.mode, "gpus": [0], "min_residency_s": 0}
    cfg["models"] = [
        {"name": name, **on_demand, "load_timeout_s": 180, "command": cfg["engine"]["command"]}
        for name in run.models
    ]
    return cfg


def _ask(daemon: Daemon, model: str) -> tuple[int, float]:
    """One short completion; (status, seconds it took)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    start = time.monotonic()
    code, _ = daemon.request("/v1/chat/completions", body, timeout=240)
    return code, time.monotonic() - start


def _engine(daemon: Daemon, model: str) -> dict[str, Any]:
    (e,) = [e for e in daemon.status()["engines"] if e["model"] == model]
    return dict(e)


def _logged(daemon: Daemon, pattern: str, after: float) -> tuple[float, str] | None:
    found = daemon.log_events(pattern, after)
    return found[0] if found else None


def _turn(run: SwapRun, daemon: Daemon, base: GpuSample, old: str, new: str) -> dict[str, Any]:
    """Ask for ``new`` while ``old`` holds GPU 0: when NVML showed old's memory back,
    when new began to load (cold, or a wake) and was loaded (seconds from the request),
    and new's answer. Asleep, old's processes live on (with their CUDA context): only
    the memory counts then."""
    was = _engine(daemon, old)
    tree = engine_tree(was["pid"])
    daemon.pids_seen.update(tree)
    limit = base.memory_used + SWAP_SHARE * base.memory_total / 2
    held = run.view.sample(0).memory_used - base.memory_used
    answers: list[tuple[int, float]] = []
    asker = threading.Thread(target=lambda: answers.append(_ask(daemon, new)), daemon=True)
    t_ask = time.time()
    asker.start()
    _, t_free = run.view.wait_until(
        0,
        lambda s: (run.mode == "sleep" or not tree & s.processes.keys()) and s.memory_used < limit,
        run.release_timeout_s,
    )
    if t_free is None:
        raise CheckFailed(f"{old}'s {gib(held)} on GPU 0 never released after {new} was asked")
    asker.join(240)
    if not answers or answers[0][0] != 200:
        raise CheckFailed(f"{new} answered {answers or 'nothing'} after {old} was put away")
    start = _logged(daemon, rf"model {new}: loading \(", t_ask - STAMP_SLACK_S)
    ready = None if start is None else _logged(daemon, rf"model {new}: loaded \(", start[0])
    if start is None or ready is None:
        raise CheckFailed(f"no 'model {new}: loading'/'loaded' line in the log")
    return {
        "from": old,
        "to": new,
        "held_bytes": held,
        "released_s": round(t_free - t_ask, 2),
        "how": start[1].split("loading (")[1].split(";")[0],
        "loading_s": round(start[0] - t_ask, 2),
        "loaded_s": round(ready[0] - t_ask, 2),
        "answer_s": round(answers[0][1], 2),
        "in_order": start[0] >= t_free - STAMP_SLACK_S,
        "on_gpu": held >= SHOWN_SHARE * SWAP_SHARE * base.memory_total,
    }


def _turns(run: SwapRun, daemon: Daemon, base: GpuSample) -> list[dict[str, Any]]:
    # Ready, not only alive: until the daemon has started, a request gets 503 "starting".
    daemon.wait_for(lambda: daemon.request("/readyz")[0] == 200, 120, "the daemon ready")
    a, b = run.models
    code, first_s = _ask(daemon, a)
    if code != 200:
        raise CheckFailed(f"{a} answered {code} on its first request")
    turns = [_turn(run, daemon, base, a, b), _turn(run, daemon, base, b, a)]
    turns[0]["first_load_s"] = round(first_s, 2)
    return turns


def _text(turns: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{t['from']} ({gib(t['held_bytes'])}) → {t['to']}: NVML memory back "
        f"{t['released_s']} s, loading ({t['how']}) {t['loading_s']} s, loaded "
        f"{t['loaded_s']} s, answered {t['answer_s']} s"
        for t in turns
    )


def swap(run: SwapRun) -> Line:
    work = run.work / run.line
    work.mkdir()
    env = daemon_env(REPO, run.fake_dir, run.run_id, work) | run.engine_env
    daemon = Daemon(work, run.python, env, swap_config(work, run))
    base = run.view.sample(0)  # GPU 0 before this daemon: what it must give back
    turns: list[dict[str, Any]] = []
    problems = []
    try:
        daemon.start()
        turns = _turns(run, daemon, base)
    except CheckFailed as exc:
        problems.append(str(exc))
    finally:
        code = daemon.stop()
    problems += [f"{t['from']}'s memory not on GPU 0" for t in turns if not t["on_gpu"]]
    problems += [
        f"{t['to']} loading before NVML showed {t['from']}'s memory back"
        for t in turns
        if not t["in_order"]
    ]
    problems += [f"the daemon exited {code} after SIGTERM"] if code != 0 else []
    left = ours_alive(daemon.pids_seen, run.run_id)
    problems += [f"processes left: {left}"] if left else []
    tolerance = 0 if run.fake_dir else 256 * 1024**2
    back, when = run.view.wait_until(
        0, lambda s: s.memory_used <= base.memory_used + tolerance, 10, 0.2
    )
    if when is None:
        problems.append(f"GPU 0 memory not back: {gib(back.memory_used)}")
    detail = "; ".join([*problems, _text(turns)] if turns else problems)
    return Line(run.line, not problems, detail, {"turns": turns, "exit_code": code})
