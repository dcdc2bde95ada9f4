"""The rules across keys and sections that one field's type and bounds cannot say, a
module per topic, each with a public ``check``: ``sections`` (the gateway's address,
GPUs, ports, engine commands, ordered limits), ``models`` (the ``[[models]]`` tables
against each other and ``[engine]``), ``on_demand`` and ``adapters`` (models on demand,
their LoRA adapters), ``sleep_ram`` (sleeping weights against host RAM), ``parsers`` and
``speculative`` (values vLLM would refuse); ``advice`` holds the warnings.

They read the schema (:mod:`appliance.config.schema`) and nothing of parsing; what they
need of the host is given (:mod:`appliance.config.checks.facts`).
:func:`appliance.config.parse.parse_config` runs :func:`check`.
"""

from __future__ import annotations

from appliance.config.checks import models, sections
from appliance.config.checks.facts import HostFacts
from appliance.config.schema import Config


def check(cfg: Config, problems: list[str], host: HostFacts | None = None) -> None:
    """Every rule, in the order their problems are listed: the sections', then the
    models'; those that read the host (adapter folders, sleeping weights) only with
    ``host``."""
    sections.check(cfg, problems)
    models.check(cfg, problems, host)
