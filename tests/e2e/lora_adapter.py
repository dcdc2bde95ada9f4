"""Write a small LoRA adapter for a Llama-shaped model, as PEFT would save one.

Run with the engine venv's python (torch and safetensors are there; peft is not
needed)::

    <engine python> tests/e2e/lora_adapter.py OUT_DIR BASE_MODEL_DIR [--r 8] [--seed 0]

``adapter_config.json`` says what vLLM's ``lora/peft_helper.py`` reads (``peft_type``
LORA, ``r``, ``lora_alpha``, ``target_modules``); ``adapter_model.safetensors`` holds
``base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight`` shaped
``[r, hidden]`` and ``[out, r]`` (``lora/utils.py`` parse_fine_tuned_lora_name), small
random values: the adapter changes the answers a little and loads like a trained one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    import torch
    from safetensors.torch import save_file

    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("base", type=Path)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    cfg = json.loads((a.base / "config.json").read_text())
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": hidden, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(a.seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for module, out in outs.items():
            prefix = f"base_model.model.model.layers.{i}.self_attn.{module}"
            lora_a = torch.randn(a.r, hidden, generator=gen) * 0.01
            lora_b = torch.randn(out, a.r, generator=gen) * 0.01
            tensors[f"{prefix}.lora_A.weight"] = lora_a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = lora_b.to(torch.bfloat16)
    a.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(a.out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": a.r,
        "lora_alpha": 2 * a.r,
        "lora_dropout": 0.0,
        "target_modules": list(outs),
        "bias": "none",
        "base_model_name_or_path": str(a.base),
        "inference_mode": True,
    }
    (a.out / "adapter_config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    main()
