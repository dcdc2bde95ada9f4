"""``llm-appliance export``: this box's models in another system's terms.

One target today, ``production-stack`` (the vLLM project's Helm chart, for a team that
moves to Kubernetes): the values go to ``-o FILE`` or stdout, and what does not carry
over goes to stderr, so ``export production-stack > values.yaml`` keeps the two apart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from appliance.config import load_config
from appliance.export.production_stack import CHART, export
from appliance.export.yaml_out import dump
from appliance.fsutil import FileWriteError


def cmd_production_stack(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    result = export(config)
    header = (
        f"Helm values for {CHART},",
        f"written by `llm-appliance export production-stack` from {config.source or 'defaults'}.",
        "helm install vllm vllm/vllm-stack -f this-file",
    )
    text = dump(result.values, header)
    if args.output and args.output != "-":
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise FileWriteError(f"cannot write {args.output}: {exc.strerror}") from None
    else:
        sys.stdout.write(text)
    for note in result.notes:
        print(f"llm-appliance: {note}", file=sys.stderr)
    return 0


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add `export production-stack` to the top-level subcommands."""
    p = sub.add_parser("export", parents=[common], help="the models as another system's config")
    targets = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    t = targets.add_parser(
        "production-stack",
        parents=[common],
        help="Helm values for vLLM production-stack (Kubernetes); notes on stderr",
    )
    t.add_argument("-o", "--output", metavar="FILE", help="write the values here (default: stdout)")
    t.set_defaults(func=cmd_production_stack)
