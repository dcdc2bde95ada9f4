"""End to end: `llm-appliance models pull` from a local hub (the packaged SmolLM2's real
files in the hub's layout; nothing leaves the machine), the printed [[models]] lines
pasted into a config, served by real vLLM on CPU and answering through the gateway."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import openai
import pytest

from appliance import paths
from tests.e2e.conftest import missing_setup, real_home, serving
from tests.fakes.appliance_proc import CLI, REPO, real_engine_config
from tests.fakes.fake_hub import FakeHub, serve_hub, smollm_repo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
pytest.importorskip("huggingface_hub")

HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_pull_paste_serve_answer(tmp_path: Path) -> None:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    source = paths.packaged_model(real_home())
    with serve_hub(FakeHub()) as hub:
        hub.add(smollm_repo(HUB_REPO, source))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "LLM_APPLIANCE_HOME": str(tmp_path / "store-home"),
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp_path / "hf"),
        }
        env.pop("HF_HUB_OFFLINE", None)
        done = subprocess.run(
            [*CLI, "models", "pull", HUB_REPO, "--name", "smol", "--config", "/dev/null"],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=300,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    folder = tmp_path / "store-home" / "models" / "smol"
    assert lines == ["[[models]]", 'name = "smol"', f'model = "{folder}"']
    cfg = real_engine_config(tmp_path, 1)
    cfg["models"] = [{"name": "smol", "model": str(folder)}]  # the printed table
    with serving(tmp_path, cfg, engines=1) as real:
        chat = openai.OpenAI(
            base_url=real.url + "/v1", api_key=real.admin_key, max_retries=0, timeout=120
        )
        answer = chat.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
        )
        assert answer.model == "smol" and answer.choices[0].message.content
        assert real.status()["engines"][0]["model"] == "smol"
