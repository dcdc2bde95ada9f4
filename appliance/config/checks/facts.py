"""What the checks need to know of the host a config runs on, given to them.

Parsing (:func:`appliance.config.parse.parse_config`) reads no file: the few checks that
depend on the host (sleeping weights against its RAM, adapter folders) ask a
:class:`HostFacts` their caller passes in. :func:`appliance.config.load.load_config`
gives the real host's (:class:`appliance.config.host.LocalHost`); a test gives a fake,
and a caller that gives none gets those checks skipped.
"""

from __future__ import annotations

from typing import Protocol


class HostFacts(Protocol):
    def mem_total(self) -> int | None:
        """The host's RAM in bytes (``MemTotal``), or None when it cannot be known."""
        ...

    def weights_bytes(self, model: str) -> int | None:
        """The size of the weights vLLM would load for ``model`` (as a config names it:
        a folder, ``packaged:NAME``, "" or a model id), or None when unknown here."""
        ...

    def adapter_rank(self, path: str) -> int:
        """The largest LoRA rank of the adapter in folder ``path``; AdapterError saying
        what is wrong with the folder otherwise."""
        ...
