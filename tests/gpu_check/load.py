"""Load through the gateway while the check reads the GPUs: streamed chat completions,
a few at a time, each token one matmul on the engine's GPU (fake_engine.py
``--gpu-share``), so power and temperature move as under a model."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import Counter

from tests.gpu_check.daemon import MODEL


class Load:
    def __init__(self, url: str, key: str, streams: int = 8, max_tokens: int = 200) -> None:
        self.url = url
        self.key = key
        self.max_tokens = max_tokens
        self.stopping = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"gpu-check-load-{i}", daemon=True)
            for i in range(streams)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(timeout=30)

    def _note(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def _run(self) -> None:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "warm the GPU"}],
                "max_tokens": self.max_tokens,
                "stream": True,
            }
        ).encode()
        while not self.stopping.is_set():
            req = urllib.request.Request(self.url + "/v1/chat/completions", data=body)
            req.add_header("Authorization", f"Bearer {self.key}")
            req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    while r.readline() and not self.stopping.is_set():
                        pass
                    self._note(str(r.status))
            except urllib.error.HTTPError as e:
                self._note(str(e.code))
                self.stopping.wait(0.2)  # a 503 during a restart: do not spin
            except OSError as e:
                self._note(type(e).__name__)
                self.stopping.wait(0.2)
