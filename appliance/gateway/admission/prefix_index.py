"""Which engine was sent which prompt beginnings: the gateway's side of prefix routing.

A request's prompt text (its protocol's, in message order: ``protocols/prompt_text.py``)
is cut into blocks of ``BLOCK_CHARS`` characters, and each block gets a hash that chains
the one before it, so block i's hash stands for the whole text up to its end: two
requests share their first k hashes exactly when they share their first k blocks of
text. The index maps a block hash to the engines it was sent to, in a bounded LRU; the
longest run of a request's hashes an engine holds is how much of its prompt that engine
has in its prefix cache, as far as the gateway can tell (vLLM may have evicted it
since; a wrong guess costs a prefill, as routing without it would). The decision is
:func:`appliance.policy.prefix.route_by_prefix`'s.

Why characters and Python's ``hash``: the gateway never tokenizes, and a text block of
512 characters is about 128 tokens, coarse enough to keep the per-request work small
and fine enough for what matters (a conversation's earlier turns, thousands of
tokens). ``hash((previous, block))`` is the cheapest chained 64-bit hash in CPython (a
slice and SipHash over it, in C; blake2b per block measured 2-3x slower here), and it is
salted per process, so a client cannot craft prompts that collide in the dict. A
collision would only send a request to an engine without its prefix.

Forgetting: an engine seen with another process, or not serving (stopped, starting,
asleep, failed), has lost its cache: its entries are dropped (one pass over the index,
only when that happens). A draining or suspect engine keeps its cache and its entries;
routing does not send it requests meanwhile (it has no room).
"""

from __future__ import annotations

import collections

from appliance.engine import EngineState

BLOCK_CHARS = 512
# The first this many blocks of a prompt are hashed (256k characters, 64k tokens or so):
# a longer prompt is placed by its beginning, and costs no more to hash than that.
MAX_BLOCKS = 512
# Block hashes remembered, all engines together: 64 Mi characters of distinct prompt
# text, 16M tokens or so, more than the KV caches of a box's engines hold; about 16 MB.
INDEX_BLOCKS = 131072
# States in which an engine still holds what it was sent (its process and KV cache).
KEEPS_CACHE = frozenset({EngineState.READY, EngineState.SUSPECT, EngineState.DRAINING})

Blocks = tuple[int, ...]


def prompt_blocks(text: str, seed: int = 0, limit: int = MAX_BLOCKS) -> Blocks:
    """The chained hashes of ``text``'s whole blocks (a last partial block is left out:
    the next turn's text continues it, so it would never match), at most ``limit`` of
    them. ``seed`` starts the chain: the model (or adapter) the request is sent as, whose
    prefix cache is its own in vLLM, so the same text for another adapter is no match."""
    out: list[int] = []
    h = seed
    end = min(len(text), BLOCK_CHARS * min(limit, MAX_BLOCKS)) - BLOCK_CHARS
    for i in range(0, end + 1, BLOCK_CHARS):
        h = hash((h, text[i : i + BLOCK_CHARS]))
        out.append(h)
    return tuple(out)


class PrefixIndex:
    """Block hash -> the engines it was sent to (a bit per engine id), least recently
    sent first; at most ``capacity`` hashes."""

    def __init__(self, capacity: int = INDEX_BLOCKS) -> None:
        self._capacity = capacity
        self._engines: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Engine id -> (its process,) when last seen serving, None when not serving.
        self._spawns: dict[int, tuple[int | None] | None] = {}
        # Engines whose entries are to go, as bits: dropped in one pass over the index at
        # its next use, however many engines restarted or slept together.
        self._forgotten = 0

    def __len__(self) -> int:
        return len(self._engines)

    def matched(self, blocks: Blocks) -> dict[int, int]:
        """Engine id -> how many of ``blocks``, from the first, it was sent (engines that
        hold none are left out)."""
        out: dict[int, int] = {}
        if not blocks:
            return out
        if self._forgotten:
            self._drop_forgotten()
        get = self._engines.get
        alive = get(blocks[0], 0)
        for n, h in enumerate(blocks):
            still = alive & get(h, 0)
            if still != alive:
                _set_all(out, alive & ~still, n)
                alive = still
                if not alive:
                    return out
        _set_all(out, alive, len(blocks))
        return out

    def record(self, engine_id: int, blocks: Blocks) -> None:
        """``engine_id`` was sent a prompt of ``blocks``: each is now its, and most recent,
        the first block most of all: when the index is full a prompt loses its end first,
        and what is left of it still matches from the beginning."""
        if self._forgotten:
            self._drop_forgotten()
        bit = 1 << engine_id
        entries = self._engines
        for h in reversed(blocks):
            entries[h] = entries.get(h, 0) | bit
            entries.move_to_end(h)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def forget(self, engine_id: int) -> None:
        """Drop everything ``engine_id`` was sent (its cache is gone), at the index's next
        use: engines that go together (a model's engines put to sleep) cost one pass."""
        self._forgotten |= 1 << engine_id

    def _drop_forgotten(self) -> None:
        bits, self._forgotten = self._forgotten, 0
        entries = self._engines
        for h in [h for h, mask in entries.items() if mask & bits]:
            left = entries[h] & ~bits
            if left:
                entries[h] = left
            else:
                del entries[h]

    def seen(self, engine_id: int, state: EngineState, pid: int | None) -> None:
        """The engine's state and process now: when it no longer holds what it held (a new
        process, or not serving), forget its entries. Called for each engine routing
        looks at; a dict lookup when nothing changed."""
        spawn = (pid,) if state in KEEPS_CACHE else None
        if self._spawns.get(engine_id) == spawn:
            return
        if self._spawns.get(engine_id) is not None:
            self.forget(engine_id)
        self._spawns[engine_id] = spawn


def _set_all(out: dict[int, int], mask: int, n: int) -> None:
    """``out[i] = n`` for each engine id ``i`` whose bit is set in ``mask``."""
    i = 0
    while mask:
        if mask & 1:
            out[i] = n
        mask >>= 1
        i += 1
