"""Convert a GGUF checkpoint into a Hugging Face model folder vLLM can serve.

Run by set-up with the ENGINE venv's python (transformers, torch, gguf and accelerate
live only there); this file imports nothing from the appliance package:

    ENGINE/bin/python convert_gguf.py --gguf DIR/SmolLM2-135M-Instruct.Q4_1.gguf --out TMPDIR

The weights are dequantized (``GgufConfig(dequantize=True)``) and saved in the given
dtype, with the tokenizer and its chat template. Set-up runs this with
``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``: everything comes from the local file.
The last line printed is ``CONVERTED {json}`` (versions, size) for set-up to record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _quant_config() -> Any:
    """``GgufConfig(dequantize=True)``; None on transformers that dequantize GGUF always."""
    try:
        from transformers import GgufConfig  # type: ignore[import-not-found,attr-defined,unused-ignore]
    except ImportError:
        try:
            from transformers.utils.quantization_config import (  # type: ignore[import-not-found,attr-defined,unused-ignore]
                GgufConfig,
            )
        except ImportError:
            return None
    return GgufConfig(dequantize=True)


def convert(gguf: Path, out: Path, dtype_name: str) -> dict[str, Any]:
    import torch  # type: ignore[import-not-found,unused-ignore]
    import transformers  # type: ignore[import-not-found,unused-ignore]
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        AutoModelForCausalLM,
        AutoTokenizer,
    )

    dtype = getattr(torch, dtype_name)
    src_dir, name = str(gguf.parent), gguf.name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    tokenizer.save_pretrained(str(out))
    kwargs: dict[str, Any] = {"gguf_file": name, "dtype": dtype}
    qc = _quant_config()
    if qc is not None:
        kwargs["quantization_config"] = qc
    model = AutoModelForCausalLM.from_pretrained(src_dir, **kwargs)
    model.save_pretrained(str(out))

    # The weights are plain now: a leftover GGUF quantization block would send vLLM
    # looking for a GGUF loader.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if "quantization_config" in cfg:
        del cfg["quantization_config"]
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    has_template = (
        bool(getattr(tokenizer, "chat_template", None)) or (out / "chat_template.jinja").exists()
    )
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "source": str(gguf),
        "dtype": dtype_name,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "chat_template": has_template,
        "bytes": size,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path, help="the .gguf file")
    ap.add_argument("--out", required=True, type=Path, help="output folder (created)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)
    if not args.gguf.is_file():
        print(f"error: no GGUF file at {args.gguf}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    info = convert(args.gguf, args.out, args.dtype)
    if not (args.out / "config.json").is_file():
        print(f"error: conversion wrote no config.json into {args.out}", file=sys.stderr)
        return 1
    print("CONVERTED " + json.dumps(info, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
