"""vLLM's LoRA adapters on the fake engine, as vLLM 0.32 serves them.

``--enable-lora`` turns them on, ``--max-lora-rank`` (default 16) bounds an adapter's
``r``, ``--lora-modules name=path|JSON ...`` are loaded at start (one that fails stops the
server, as ``init_static_loras`` raises). With ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
true the development routes ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` exist (``entrypoints/serve/lora/api_router.py``), answering
in vLLM's words and shapes (``entrypoints/openai/models/serving.py``). An adapter
answers under its own name and is listed in ``/v1/models`` with its base model as
``parent`` and its folder as ``root``. No weights are read: a folder is an adapter when
its ``adapter_config.json`` has an ``r``, unless its weights file starts with
``garbage`` (refused as vLLM refuses a corrupt safetensors file).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from aiohttp import web

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--lora-modules", nargs="+", default=None)


def _error(message: str, err_type: str, code: int) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return web.json_response(body, status=code)


class FakeLora:
    def __init__(self, args: argparse.Namespace, base: list[str]) -> None:
        self.enabled = bool(args.enable_lora)
        self.max_rank = int(args.max_lora_rank)
        self.base = base
        self.adapters: dict[str, str] = {}  # name -> folder
        self.loads = 0

    @staticmethod
    def runtime_updates() -> bool:
        return os.environ.get(RUNTIME_ENV, "0").strip().lower() in ("1", "true")

    def load_static(self, modules: list[str] | None) -> None:
        """--lora-modules name=path: loaded at start; a failure ends the server (vLLM)."""
        for item in modules or ():
            if "=" in item and "," not in item:  # vLLM's old form: name=path
                name, _, path = item.partition("=")
            else:  # else JSON, as vLLM's LoRAParserAction reads it
                module = json.loads(item)
                name, path = module["name"], module["path"]
            failed = self._load(name, path)
            if failed is not None:
                raise SystemExit(f"ValueError: {failed}")

    def add_routes(self, r: web.UrlDispatcher) -> None:
        if self.runtime_updates():
            r.add_post("/v1/load_lora_adapter", self.load)
            r.add_post("/v1/unload_lora_adapter", self.unload)

    def serves(self, name: str) -> bool:
        return name in self.adapters

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": self.base[0],
                "max_model_len": None,
            }
            for name, path in self.adapters.items()
        ]

    def _load(self, name: str, path: str) -> str | None:
        """None when loaded, else vLLM's message for why not."""
        if not self.enabled:
            return "LoRA is not enabled. Use --enable-lora to enable LoRA."
        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            rank = int(config["r"])
        except (OSError, ValueError, KeyError, TypeError):
            return f"Loading lora {name} failed: No adapter found for {path}"
        weights = Path(path) / "adapter_model.safetensors"
        if weights.is_file() and weights.read_bytes().startswith(b"garbage"):
            return (
                "Call to add_lora method failed: Worker failed with error 'Error while "
                "deserializing header: header too large', please check the stack trace "
                "above for the root cause"
            )
        if rank > self.max_rank:
            return (
                "Call to add_lora method failed: Worker failed with error 'LoRA rank "
                f"{rank} is greater than max_lora_rank {self.max_rank}.', please check the "
                "stack trace above for the root cause"
            )
        self.adapters[name] = path
        self.loads += 1
        return None

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            message = "Both 'lora_name' and 'lora_path' must be provided."
            return _error(message, "InvalidUserInput", 400)
        if name in self.base:
            return _error(
                f"The lora adapter '{name}' conflicts with a served base model.",
                "InvalidUserInput",
                400,
            )
        if name in self.adapters:
            return _error(
                f"The lora adapter '{name}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )
        failed = self._load(name, path)
        if failed is None:
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
        if failed.startswith("Loading lora"):
            return _error(failed, "NotFoundError", 404)
        return _error(failed, "InternalServerError", 500)

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("lora_name")
        if name not in self.adapters:
            return _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
