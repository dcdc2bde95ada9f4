"""LoRA adapter folders for tests: what check-config and the admin call read of one.

:func:`fake_adapter` writes an ``adapter_config.json`` with the fields vLLM requires and
a placeholder weights file: enough for the appliance's checks and the fake engine (which
reads no weights). The real-vLLM e2e test writes real weights (tests/e2e/lora_adapter.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def fake_adapter(folder: Path, r: int = 8, **extra: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": ["q_proj", "v_proj"],
        **extra,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    return folder
