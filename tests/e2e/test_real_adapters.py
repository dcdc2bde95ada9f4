"""LoRA adapters as models on real vLLM (CPU), through the official ``openai`` client.

One daemon, one engine: SmolLM2 ("chat") with the adapter "sql" in its config, a rank-8
LoRA the test writes itself (tests/e2e/lora_adapter.py, random weights, with the engine
venv's torch). The engine starts with vLLM's --enable-lora and the adapter; the admin
adds a second one at run time and removes it; a malformed folder is refused in words
and the engine serves on.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appliance import paths
from tests.e2e.conftest import RealAppliance, missing_setup, real_home, serving
from tests.fakes.appliance_proc import real_engine_config
from tests.fakes.http_json import call_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
WRITER = Path(__file__).with_name("lora_adapter.py")


def write_adapter(out: Path, seed: int) -> Path:
    home = real_home()
    base = paths.packaged_model(home)
    python = str(paths.engine_python(home))
    subprocess.run([python, str(WRITER), str(out), str(base), "--seed", str(seed)], check=True)
    return out


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAppliance]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-adapters")
    write_adapter(tmp / "lora" / "sql", 1)
    write_adapter(tmp / "lora" / "sql2", 2)
    cfg = real_engine_config(tmp, 1)
    cfg["models"] = [
        {
            "name": "chat",
            "model": "packaged:smollm2-135m-instruct",
            "adapters": [{"name": "sql", "path": str(tmp / "lora" / "sql")}],
        }
    ]
    with serving(tmp, cfg, engines=1) as real:
        yield real


def client(box: RealAppliance) -> openai.OpenAI:
    return openai.OpenAI(base_url=box.url + "/v1", api_key=box.admin_key, max_retries=0)


def ask(box: RealAppliance, model: str) -> str:
    chat = client(box).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    assert chat.model == model
    content = chat.choices[0].message.content
    assert content
    return content


def admin(box: RealAppliance, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    return call_json(box.url, box.admin_key, method, path, body, timeout=180)


def test_the_configs_adapter_answers_under_its_own_name(box: RealAppliance) -> None:
    listed = {m.id: getattr(m, "parent", None) for m in client(box).models.list()}
    assert listed == {"chat": None, "sql": "chat"}
    print(f"\n[e2e] sql says: {ask(box, 'sql')!r}; chat says: {ask(box, 'chat')!r}")
    lines = [" ".join(p.cmdline()) for p in box.processes()]
    module = '--lora-modules {"name": "sql", "path": '  # vLLM's JSON form (lora.py)
    assert any("--enable-lora" in c and module in c for c in lines), lines


def test_an_admin_adds_an_adapter_at_run_time_and_it_answers(box: RealAppliance) -> None:
    code, body = admin(
        box, "POST", "/admin/models/chat/adapters", {"name": "sql2", "path": f"{box.tmp}/lora/sql2"}
    )
    assert code == 200, body
    print(f"\n[e2e] sql2 says: {ask(box, 'sql2')!r}")
    assert "sql2" in {m.id for m in client(box).models.list()}


def test_a_malformed_adapter_is_a_clear_error_and_the_engine_serves_on(
    box: RealAppliance,
) -> None:
    bad = box.tmp / "lora" / "bad"
    bad.mkdir(parents=True)
    (bad / "adapter_config.json").write_text(
        (box.tmp / "lora" / "sql" / "adapter_config.json").read_text()
    )
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    code, body = admin(
        box, "POST", "/admin/models/chat/adapters", {"name": "bad", "path": str(bad)}
    )
    assert (code, body["error"]["code"]) == (400, "adapter_invalid"), body
    print(f"\n[e2e] refused: {body['error']['message']}")
    code, body = admin(box, "POST", "/admin/models/chat/adapters", {"name": "x", "path": "/nope"})
    assert (code, body["error"]["code"]) == (400, "adapter_invalid"), body
    assert "no such folder" in body["error"]["message"]
    ask(box, "sql")


def test_a_removed_adapter_is_gone(box: RealAppliance) -> None:
    code, body = admin(box, "DELETE", "/admin/models/chat/adapters/sql2")
    assert code == 200, body
    with pytest.raises(openai.NotFoundError):
        ask(box, "sql2")
    ask(box, "sql")
