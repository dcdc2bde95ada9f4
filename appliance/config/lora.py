"""LoRA adapters (issue 23): what makes a folder an adapter vLLM can load, and the flags
its base model's engines need.

vLLM 0.32 (``vllm/lora/peft_helper.py``) reads ``adapter_config.json`` (``r``,
``lora_alpha``, ``target_modules`` required; ``rank_pattern`` may raise a module's rank)
and refuses an adapter whose largest rank is above the engine's ``--max-lora-rank``,
which takes only the values of :data:`MAX_LORA_RANKS`. The weights are
``adapter_model.safetensors`` (or ``.bin`` / ``.pt``, PEFT's older files). The same
checks serve check-config and the admin's ``POST /admin/models/{name}/adapters``, so a
bad folder is named before an engine ever sees it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from appliance.config.lora_trust import untrusted
from appliance.config.schema import NAME_RE, ServedModel

ADAPTER_CONFIG = "adapter_config.json"  # what makes a folder a PEFT (LoRA) adapter
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
REQUIRED = ("r", "lora_alpha", "target_modules")  # PEFTHelper's required fields
# vLLM 0.32's --max-lora-rank choices (vllm/config/lora.py MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_DEFAULT_RANK = 16  # --enable-lora without --max-lora-rank
MAX_LORAS_CAP = 4  # --max-loras (adapters in one batch): each slot costs memory per rank
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # opens /v1/load_lora_adapter and unload
# With RUNTIME_ENV on, vLLM asks its LoRA resolver plugins about any `model` it does not
# serve and loads what they find: a folder under the cache dir, or a hub repo
# (vllm/plugins/lora_resolvers). Only the appliance says what an engine loads.
RESOLVER_ENV = ("VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_LORA_RESOLVER_HF_REPO_LIST")
MAX_CONFIG_BYTES = 1024 * 1024
MAX_PATH = 4096  # Linux's PATH_MAX


NAME_RULE = "must be 1-64 characters of a-z 0-9 . _ -, not dots alone"


def good_name(name: object) -> bool:
    """An adapter's name is a model name that can also stand in a URL path (DELETE
    /admin/models/{name}/adapters/{adapter}): "." and ".." would be read as a path's
    steps by every client on the way."""
    return isinstance(name, str) and bool(NAME_RE.fullmatch(name)) and name.strip(".") != ""


class AdapterError(ValueError):
    """Why a folder is not an adapter vLLM could load (said to the admin as it is)."""


class UnsafeAdapter(AdapterError):
    """Another local account could change the folder before the engine loads it
    (:mod:`appliance.config.lora_trust`)."""


def adapter_rank(path: str) -> int:
    """The adapter's largest LoRA rank, read from its folder ``path``; AdapterError saying
    what is wrong with the folder otherwise (the caller names the folder)."""
    folder = _safe_folder(path)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise AdapterError(f"not a LoRA adapter (no {ADAPTER_CONFIG} in it)")
    try:
        raw = config_file.read_bytes()[: MAX_CONFIG_BYTES + 1]
        data = json.loads(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterError(f"{ADAPTER_CONFIG} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{ADAPTER_CONFIG} must hold a JSON object")
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type is {peft_type!r}; vLLM serves LORA adapters only")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise AdapterError(f"{ADAPTER_CONFIG} lacks {', '.join(missing)}")
    pattern = data.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise AdapterError(f"{ADAPTER_CONFIG}'s rank_pattern must be a JSON object")
    ranks = [data["r"], *pattern.values()]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks):
        raise AdapterError(f"{ADAPTER_CONFIG}'s r must be a positive integer")
    if not any((folder / w).is_file() for w in WEIGHTS):
        raise AdapterError(f"no weights in it ({' or '.join(WEIGHTS)})")
    return int(max(ranks))


def _safe_folder(path: str) -> Path:
    """``path`` as a folder only trusted accounts can change; AdapterError otherwise."""
    if len(path) > MAX_PATH or "\0" in path:
        raise AdapterError(f"must be a folder's path: at most {MAX_PATH} characters, no NUL")
    folder = Path(path)
    if not folder.is_absolute():
        raise AdapterError("must be an absolute path")
    if not folder.is_dir():
        raise AdapterError("no such folder")
    try:
        problem = untrusted(path)
    except OSError as exc:
        raise AdapterError(f"cannot be looked at ({exc.strerror or exc})") from None
    if problem is not None:
        raise UnsafeAdapter(problem)
    return folder


def fitting_rank(rank: int) -> int | None:
    """The smallest --max-lora-rank vLLM takes that holds ``rank`` (None: none does)."""
    return next((r for r in MAX_LORA_RANKS if r >= rank), None)


def lora_args(adapters: Sequence[tuple[str, str]], ranks: Iterable[int]) -> list[str]:
    """vLLM's LoRA flags for a base model's engines: the config's adapters loaded at start
    (``--lora-modules``), a rank that holds every adapter known at plan time
    (the config's and the admin's kept ones: ``ranks``), and a batch of several."""
    known = list(ranks)
    rank = fitting_rank(max(known, default=1)) or MAX_LORA_RANKS[-1]
    args = ["--enable-lora", "--max-lora-rank", str(rank)]
    args += ["--max-loras", str(max(1, min(len(known), MAX_LORAS_CAP)))]
    if adapters:
        # vLLM's JSON form: its name=path form is read as JSON when the path has a comma.
        modules = (json.dumps({"name": name, "path": path}) for name, path in adapters)
        args += ["--lora-modules", *modules]
    return args


def engine_rank(argv: Sequence[str]) -> int:
    """The --max-lora-rank an engine runs with, read from its whole command line (the
    appliance's flags, then extra_args, or a model's own command: argparse takes the
    last); 0 when LoRA is off (no --enable-lora)."""
    if "--enable-lora" not in argv:
        return 0
    rank = VLLM_DEFAULT_RANK
    for i, arg in enumerate(argv):
        value = None
        if arg == "--max-lora-rank" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--max-lora-rank="):
            value = arg.partition("=")[2]
        if value is not None and value.isdigit():
            rank = int(value)
    return rank


def with_lora(
    served: ServedModel,
    argv: tuple[str, ...],
    env: dict[str, str],
    kept: Sequence[int] = (),
) -> tuple[tuple[str, ...], int]:
    """An engine's command line with the LoRA flags its model needs, and the rank it will
    run with (0: LoRA off); ``env`` gets :data:`RUNTIME_ENV` when LoRA is on, so the
    supervisor can load and unload adapters on the engine's private socket. ``kept``: the
    ranks of the adapters the admin added to this model at run time (kept across
    restarts). A model's own ``command`` gets no flags (it is the whole command line:
    it says ``--enable-lora`` itself); its adapters are then all loaded at run time."""
    e = served.engine
    if (served.adapters or kept) and not e.command:
        ranks, static = list(kept), []
        for a in served.adapters:
            try:
                ranks.append(adapter_rank(a.path))
            except AdapterError:
                # Not on the command line: vLLM would not start at all. Check-config names
                # it, and the engine's runner refuses it again in the journal (sync).
                continue
            static.append((a.name, a.path))
        flags = lora_args(static, ranks)
        tail = len(e.extra_args)  # the admin's extra_args stay last: theirs win
        cut = len(argv) - tail if tail and argv[-tail:] == tuple(e.extra_args) else len(argv)
        argv = (*argv[:cut], *flags, *argv[cut:])
    rank = engine_rank(argv)
    if rank:
        env.setdefault(RUNTIME_ENV, "true")
        for name in RESOLVER_ENV:  # see RESOLVER_ENV: never a client's name to a folder
            env.pop(name, None)
    return argv, rank
