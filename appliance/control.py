"""The one door between the supervisor and the gateway: frozen status types and Protocols.

Neither side imports the other. Each depends on this module alone, and the composition
root (:mod:`appliance.serve`) hands each its half of the other::

    gateway ──reads──► ApplianceView   (status snapshots: frozen, copied, never live)
            ──calls──► EngineCommands  (restart / drain / resume / check_listener
                                        → CommandResult)
            ──calls──► ModelDoor       (models on demand: use / load / unload a model,
                                        each model's state; LoRA adapters: which
                                        there are, add / remove one)
                         ▲ implemented by the supervisor
    supervisor ─calls─► GatewayLink    (work in flight, KV breaker, throttle, GPU readings,
                                        shutdown)
                         ▲ implemented by the gateway

A command does not change an engine: it is a request that the engine's runner (the only
code that moves that engine's state) answers from its own task; the caller awaits the
answer. Everything the gateway shows about an engine or a GPU comes from the status types
below, so "which telemetry entry stands for this engine" is decided here, once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from appliance.config import Config
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.engine_cpu import CpuDtype
from appliance.telemetry import GpuReading


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """One engine as its runner last saw it; a copy, so it never changes under a reader."""

    id: int
    gpu: int | None  # CUDA index, or None on CPU
    address: EngineAddress
    state: EngineState
    api_key: str  # this spawn's engine key; the gateway sends it, clients never see it
    served_model_name: str = ""
    pid: int | None = None  # the API server's, while it runs
    restarts: int = 0
    restarts_by_reason: Mapping[str, int] = field(default_factory=dict)
    last_restart_reason: str | None = None
    # vLLM's figures from the engine's last health check (None: not read, not reported).
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions_total: float | None = None
    generation_tokens: float | None = None
    model: str = ""  # the served model's name
    gpus: tuple[int, ...] = ()  # all its GPUs (tensor parallel: several); () on CPU
    task: str = "generate"  # "generate" | "embed"
    # Speculative decoding (None: the engine does not speculate): vLLM's counters as last
    # read, and over the last minute the share of proposed tokens accepted and the tokens
    # a step yields per sequence (1 + accepted / drafts).
    spec_drafts: float | None = None
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None
    spec_acceptance_rate: float | None = None
    spec_mean_accepted_length: float | None = None
    last_exit: str | None = None  # why its process last exited, in one line (None: never)

    @property
    def port(self) -> int | None:
        return self.address.port

    @property
    def base_url(self) -> str:
        return self.address.base_url

    @property
    def telemetry_index(self) -> int:
        """The telemetry entry that stands for this engine: its GPU's index, else its id
        (engine i of a CPU box is telemetry entry i, so a sensors file can heat it)."""
        return self.gpu if self.gpu is not None else self.id

    @property
    def telemetry_indexes(self) -> tuple[int, ...]:
        """Every telemetry entry of this engine: all its GPUs (tensor parallel), else its id."""
        return self.gpus or (self.telemetry_index,)


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One telemetry entry (a GPU, or a CPU engine's stand-in) and its throttle level."""

    reading: GpuReading
    throttle_level: int = 0  # the thermal governor's: 0 = none, policy.thermal.HARD_LEVEL = all

    @property
    def index(self) -> int:
        return self.reading.index


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One configured model's load state (models on demand, issue 23)."""

    name: str
    load: str  # "always" | "on_demand"
    state: str  # "loaded" | "loading" | "sleeping" | "unloaded" (the contract's names)
    last_used: float | None  # time.time() of its last request; None: none yet
    detail: str = ""  # the lifecycle's own name (draining, unloading) where it says more
    loads: Mapping[str, int] = field(default_factory=dict)  # by how: "cold", "wake"
    # Its loads' durations: a count per LOAD_BUCKETS bucket (the last: above them all).
    load_buckets: tuple[int, ...] = ()
    load_seconds_sum: float = 0.0
    # Its engines run the model repository's own Python (vLLM --trust-remote-code).
    trust_remote_code: bool = False


# appliance_model_load_seconds' buckets: a wake takes about a second, a cold start minutes.
LOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True, slots=True)
class ApplianceStatus:
    """The whole box at one moment: what /admin/status, /metrics and `status` show."""

    started_at: float  # time.time() of the daemon's start
    device: str | None  # "cuda" | "cpu"; None until the engines are planned
    cpu_dtype: CpuDtype | None  # CPU engines' dtype and why (None on GPU or with a command)
    accepting: bool  # False once shutdown began: new requests are refused
    ready: bool  # accepting, and some engine is READY
    engines: tuple[EngineStatus, ...]
    gpus: tuple[GpuStatus, ...]  # by index
    models: tuple[ModelStatus, ...] = ()  # every configured model, in config order

    def gpu(self, index: int) -> GpuStatus | None:
        return next((g for g in self.gpus if g.index == index), None)


@dataclass(frozen=True, slots=True)
class CommandResult:
    """A runner's answer to an engine command; the HTTP handler turns it into a status."""

    ok: bool
    state: EngineState  # the engine's state once the command was handled
    message: str = ""  # why not, when not ok: said to the admin as it is


class ApplianceView(Protocol):
    """What the gateway may read of the running appliance (read-only)."""

    @property
    def config(self) -> Config:
        """The config in force (a reload replaces it)."""
        ...

    @property
    def accepting(self) -> bool: ...

    @property
    def starting(self) -> bool:
        """Not accepting yet because the daemon is starting (an earlier run's leftover
        engines are being swept), as opposed to stopping."""
        ...

    @property
    def last_tick(self) -> float:
        """time.monotonic() of the supervisor loop's last tick (a stalled loop is not alive)."""
        ...

    @property
    def started_at(self) -> float: ...

    def engines(self) -> tuple[EngineStatus, ...]:
        """Every engine, by id (engine i at index i)."""
        ...

    def engine(self, engine_id: int) -> EngineStatus:
        """One engine (IndexError for an id no engine has)."""
        ...

    def status(self) -> ApplianceStatus: ...


class EngineCommands(Protocol):
    """What the gateway may ask of an engine (scope admin). Each answer comes from the
    engine's runner; the caller bounds its wait."""

    async def restart(self, engine_id: int) -> CommandResult:
        """Drain, then restart: ok means the restart was asked for (it happens later)."""
        ...

    async def drain(self, engine_id: int, *, force: bool = False) -> CommandResult:
        """No new work until resumed; the last engine serving drains only with ``force``."""
        ...

    async def resume(self, engine_id: int) -> CommandResult: ...

    async def check_listener(self, engine_id: int) -> CommandResult:
        """Check the engine now, its TCP listener first (the gateway found someone else
        on its port): answered once that check is done. ok: the listener is the
        engine's own; not ok: it is being replaced, or is not running (``message``)."""
        ...


@dataclass(frozen=True, slots=True)
class ModelResult:
    """The answer to an admin's load or unload of a model."""

    ok: bool
    state: str  # the model's state (ModelStatus.state) once the command was taken
    message: str = ""


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    """One LoRA adapter served as a model name of its own (issue 23)."""

    name: str  # what clients send as "model"
    model: str  # its base model's (canonical) name: whose engines serve it
    path: str  # its folder (shown to admins only)
    source: str  # "config" (the model's adapters) | "admin" (added at run time, kept)


@dataclass(frozen=True, slots=True)
class AdapterResult:
    """The answer to an admin's add or remove of an adapter: ``status`` is the HTTP
    status the handler answers with (200 done; 4xx refused, ``code`` saying why)."""

    status: int
    message: str = ""
    code: str = ""

    @property
    def ok(self) -> bool:
        return self.status < 300


@runtime_checkable
class ModelDoor(Protocol):
    """Models on demand, as the gateway asks for them (implemented by the supervisor)."""

    def want_model(self, name: str) -> bool:
        """A request for ``name`` (canonical, an on-demand model) passed every check: when
        the model is not loaded, ask for its load. True: loaded (no wait for a load).
        Marks nothing: only :meth:`model_used` does."""
        ...

    def model_used(self, name: str) -> None:
        """A request for ``name`` (canonical) was admitted to one of its engines: mark it
        used (its idle unload and the swap's least recently used count from here). A
        refused request (503 no_engine, queue_full, queue_timeout, ...) never comes here,
        so a flood of refusals does not keep a model "recently used". Per request: cheap."""
        ...

    def models(self) -> tuple[ModelStatus, ...]: ...
    async def load_model(self, name: str) -> ModelResult: ...
    async def unload_model(self, name: str) -> ModelResult: ...

    def adapter_names(self) -> Mapping[str, str]:
        """Every adapter's name -> its base model's name (per request: no copy made)."""
        ...

    def adapters(self) -> tuple[AdapterStatus, ...]: ...
    async def add_adapter(self, model: str, name: str, path: str) -> AdapterResult: ...
    async def remove_adapter(self, model: str, name: str) -> AdapterResult: ...


class NoModels:
    """The door for an appliance without models on demand (unit tests' fakes)."""

    def want_model(self, name: str) -> bool:
        return True

    def model_used(self, name: str) -> None:
        pass

    def models(self) -> tuple[ModelStatus, ...]:
        return ()

    async def load_model(self, name: str) -> ModelResult:
        return ModelResult(False, "loaded", "models on demand are not available here")

    async def unload_model(self, name: str) -> ModelResult:
        return ModelResult(False, "loaded", "models on demand are not available here")

    def adapter_names(self) -> Mapping[str, str]:
        return {}

    def adapters(self) -> tuple[AdapterStatus, ...]:
        return ()

    async def add_adapter(self, model: str, name: str, path: str) -> AdapterResult:
        return AdapterResult(409, "adapters are not available here", "adapters_unavailable")

    async def remove_adapter(self, model: str, name: str) -> AdapterResult:
        return AdapterResult(409, "adapters are not available here", "adapters_unavailable")


class Appliance(ApplianceView, EngineCommands, Protocol):
    """The gateway's whole view of the supervisor."""


class GatewayLink(Protocol):
    """What the supervisor tells the gateway and asks of it (implemented by the gateway)."""

    def inflight(self, engine_id: int) -> int: ...
    def adapter_requests(self, name: str) -> int:
        """Requests for the LoRA adapter ``name`` not yet answered (queued or running)."""
        ...

    def observe_kv(self, engine_id: int, usage: float | None) -> None: ...
    def kv_tripped(self, engine_id: int) -> bool: ...
    def set_throttle(self, engine_id: int, level: int) -> None: ...
    def telemetry_read(self, gpus: tuple[GpuStatus, ...]) -> None:
        """The GPUs as just read, once per telemetry tick (energy per key is shared out
        here): cheap, on the supervisor's loop."""
        ...

    def engines_changed(self) -> None: ...
    def queued_since(self, model: str) -> float | None:
        """When the longest-waiting request for ``model`` began to wait in the gateway's
        queue (time.monotonic); None: nobody waits. Models on demand: such a model is
        wanted, loaded or not when its requests came."""
        ...

    def abandon(self, engine_id: int, why: str) -> int:
        """Give up the requests on a hung or drained-out engine; how many there were."""
        ...

    def shutdown_begun(self) -> None:
        """Shutdown began: refuse everyone still waiting for an engine."""
        ...

    def reload(self) -> None:
        """SIGHUP: re-read the keys file."""
        ...


class NoGateway:
    """The link before a gateway is connected (and for a supervisor run without one)."""

    def inflight(self, engine_id: int) -> int:
        return 0

    def adapter_requests(self, name: str) -> int:
        return 0

    def observe_kv(self, engine_id: int, usage: float | None) -> None:
        pass

    def kv_tripped(self, engine_id: int) -> bool:
        return False

    def set_throttle(self, engine_id: int, level: int) -> None:
        pass

    def telemetry_read(self, gpus: tuple[GpuStatus, ...]) -> None:
        pass

    def engines_changed(self) -> None:
        pass

    def queued_since(self, model: str) -> float | None:
        return None

    def abandon(self, engine_id: int, why: str) -> int:
        return 0

    def shutdown_begun(self) -> None:
        pass

    def reload(self) -> None:
        pass


@dataclass(frozen=True)
class Listening:
    """The HTTP side once it listens: its link, and how to close it at exit."""

    link: GatewayLink
    close: Callable[[], Awaitable[None]]


StartHttp = Callable[[], Awaitable[Listening]]
