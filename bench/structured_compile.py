"""How long one JSON schema keeps a structured-output backend busy (issue 33, item 1).

Runs in the engine venv (it imports xgrammar, llguidance and transformers, which only
that venv has), with the packaged model's tokenizer, from the repository's root (as a
module: run as a file, bench/profile.py would shadow the standard library's)::

    timeout 300 ~/.local/share/llm-appliance/engine-venv/bin/python \\
        -m bench.structured_compile xgrammar 3
    ~/.local/share/llm-appliance/engine-venv/bin/python -m bench.structured_compile guidance 30

The schema is ``{"type": "string", "pattern": P}`` with ``P`` ``[a-z]{1,9}`` nested
``N`` levels deep in ``(...){1,9}``: the 57-byte schema of the issue is N = 3. Timed:

- ``xgrammar``: ``GrammarCompiler.compile_json_schema`` on one thread, the compile vLLM
  0.32's default backend runs ahead of generation (no time limit: run it under
  ``timeout``);
- ``guidance``: what vLLM's guidance backend does before and during generation:
  ``grammar_from_json_schema``, ``validate_grammar``, an ``LLMatcher``, then 20 token
  masks, each followed by consuming the first token it allows.

Results: docs/security.md ("What one request can make an engine do").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

MODEL = Path.home() / ".local/share/llm-appliance/models/SmolLM2-135M-Instruct"
MASKS = 20


def nested_pattern(levels: int) -> str:
    pattern = "[a-z]{1,9}"
    for _ in range(levels - 1):
        pattern = f"({pattern}){{1,9}}"
    return pattern


def time_xgrammar(tokenizer: Any, schema: str) -> float:
    import xgrammar as xgr  # type: ignore[import-not-found]  # the engine venv's

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    started = time.monotonic()
    compiler.compile_json_schema(schema, any_whitespace=True)
    return time.monotonic() - started


def time_guidance(tokenizer: Any, schema: str) -> float:
    import llguidance  # type: ignore[import-not-found]  # the engine venv's
    import llguidance.hf  # type: ignore[import-not-found]
    import llguidance.torch  # type: ignore[import-not-found]

    lltok = llguidance.hf.from_tokenizer(tokenizer, len(tokenizer))
    started = time.monotonic()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": True}
    )
    error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
    if error:
        raise SystemExit(f"guidance refused the schema: {error}")
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=1)
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    for _ in range(MASKS):
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_stopped() or matcher.get_error():
            break
        allowed = next(t for t in range(lltok.vocab_size) if (mask[0, t // 32] >> (t % 32)) & 1)
        matcher.consume_token(allowed)
    return time.monotonic() - started


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("xgrammar", "guidance") or not argv[1].isdigit():
        print(__doc__)
        return 2
    from transformers import AutoTokenizer  # type: ignore[import-not-found]

    backend, levels = argv[0], int(argv[1])
    schema = json.dumps({"type": "string", "pattern": nested_pattern(levels)})
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    timer = time_xgrammar if backend == "xgrammar" else time_guidance
    print(f"{backend} n={levels} ({len(schema)} bytes): {timer(tokenizer, schema):.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
