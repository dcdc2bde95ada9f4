"""/admin/status says which dtype CPU engines run and why (null where it does not apply).

From the plan (what the supervisor starts engines with) to the status document (what
`llm-appliance status --json` prints), with the status document's real parts over a box with
no engine yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance import paths
from appliance.config import parse_config
from appliance.control import NoModels
from appliance.gateway.admission.gate import Admission
from appliance.gateway.keys import KeyStore
from appliance.gateway.observe.probes import Readiness
from appliance.gateway.observe.status_document import StatusDocument
from appliance.plan import plan_engines
from tests.fakes.fake_appliance import FakeAppliance


@pytest.fixture
def home(tmp_path: Path) -> Path:
    python = paths.engine_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    model = paths.packaged_model(tmp_path)
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    return tmp_path


def status_with(
    home: Path, engine: dict[str, Any], *, gpus: int, flags: frozenset[str]
) -> dict[str, Any]:
    config = parse_config({"engine": engine})
    plan = plan_engines(
        config,
        gpu_count=gpus,
        cores=[0, 1],
        home=home,
        base_env={},
        socket_dir=home / "run",
        cpu_flags=flags,
        preload=(),
    )
    # Nothing runs yet: the box has no engines, and /readyz's verdict (which the document
    # carries) is read from real parts.
    box = FakeAppliance(config, [])
    box._starting, box._device, box._cpu_dtype = True, plan.device, plan.cpu_dtype
    admission = Admission(lambda: config, box.engines, lambda: True)
    keys = KeyStore(home / "keys.json")
    readiness = Readiness(box, keys, admission, NoModels(), lambda: ())
    return StatusDocument(box, admission, keys, readiness, NoModels(), lambda: ()).build()


@pytest.mark.parametrize(
    ("flags", "dtype", "why"),
    [
        (frozenset({"avx2"}), "float32", "neither avx512_bf16 nor amx_bf16"),
        (frozenset({"avx2", "avx512_bf16"}), "bfloat16", "avx512_bf16"),
    ],
)
def test_status_names_the_cpu_engines_dtype_and_why(
    home: Path, flags: frozenset[str], dtype: str, why: str
) -> None:
    doc = status_with(home, {"device": "cpu"}, gpus=0, flags=flags)
    assert doc["device"] == "cpu"
    assert doc["cpu_dtype"]["dtype"] == dtype
    assert why in doc["cpu_dtype"]["reason"]


def test_status_shows_an_explicit_dtype_as_the_admin_s(home: Path) -> None:
    engine = {"device": "cpu", "extra_args": ["--dtype=bfloat16"]}
    doc = status_with(home, engine, gpus=0, flags=frozenset({"avx2"}))
    assert doc["cpu_dtype"] == {"dtype": "bfloat16", "reason": "engine.extra_args sets --dtype"}


def test_status_cpu_dtype_is_null_on_gpu(home: Path) -> None:
    doc = status_with(home, {}, gpus=1, flags=frozenset({"avx512_bf16"}))
    assert doc["device"] == "cuda"
    assert doc["cpu_dtype"] is None
