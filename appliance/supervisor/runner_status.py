"""The frozen copy of one engine that others read: :class:`appliance.control.EngineStatus`.

Built from what the runner's parts hold (its spec, its processes, what its checks
learned, its restarts); the state is passed in by the runner, its only holder.
"""

from __future__ import annotations

from appliance.control import EngineStatus
from appliance.engine import EngineSpec, EngineState
from appliance.health import Observation
from appliance.policy.speculation import NO_FIGURES, SpecFigures
from appliance.supervisor.budget import RestartBook
from appliance.supervisor.commands import ProcessHandle


def engine_status(
    spec: EngineSpec,
    state: EngineState,
    process: ProcessHandle,
    book: RestartBook,
    observed: Observation | None,
    speculation: SpecFigures = NO_FIGURES,
) -> EngineStatus:
    obs = observed
    return EngineStatus(
        id=spec.id,
        gpu=spec.gpu,
        address=spec.address,
        state=state,
        api_key=process.api_key,
        served_model_name=spec.served_model_name,
        model=spec.model or spec.served_model_name,
        gpus=spec.gpus,
        task=spec.task,
        pid=process.pid,
        restarts=book.restarts,
        restarts_by_reason=dict(book.by_reason),
        last_restart_reason=book.last_reason,
        kv_cache_usage=obs.kv_cache_usage if obs else None,
        running=obs.running if obs else None,
        waiting=obs.waiting if obs else None,
        preemptions_total=obs.preemptions_total if obs else None,
        generation_tokens=obs.generation_tokens if obs else None,
        spec_drafts=obs.spec_drafts if obs else None,
        spec_draft_tokens=obs.spec_draft_tokens if obs else None,
        spec_accepted_tokens=obs.spec_accepted_tokens if obs else None,
        spec_acceptance_rate=speculation.acceptance_rate,
        spec_mean_accepted_length=speculation.mean_accepted_length,
        last_exit=process.last_exit,
    )
