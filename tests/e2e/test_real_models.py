"""Two models side by side on real vLLM (CPU): a chat model and an embedding model.

SmolLM2 serves ``chat`` (alias ``gpt-4o-mini``) and all-MiniLM-L6-v2 serves ``embed``
(vLLM's pooling runner), one engine each, each pinned to its own core. The official
``openai`` client gets a chat completion from one and real embeddings from the other;
SIGKILL of the embedding engine leaves chat answering throughout.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Iterator

import openai
import pytest

from appliance import paths
from tests.e2e.conftest import READY_TIMEOUT_S, RealAppliance, missing_setup, real_home, serving
from tests.fakes.appliance_proc import real_engine_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
EMBED_MODEL = "all-minilm-l6-v2"


def missing_embedding_model() -> str | None:
    folder = paths.packaged_model(real_home(), EMBED_MODEL)
    if not (folder / "config.json").exists():
        return (
            f"packaged:{EMBED_MODEL} is not prepared at {folder}: run `llm-appliance setup "
            "--config` with a config that names it"
        )
    return None


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAppliance]:
    reason = missing_setup() or missing_embedding_model()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-models")
    cfg = real_engine_config(tmp, 1)
    cfg["models"] = [
        {"name": "chat", "aliases": ["gpt-4o-mini"], "model": "packaged:smollm2-135m-instruct"},
        {"name": "embed", "model": f"packaged:{EMBED_MODEL}"},
    ]
    with serving(tmp, cfg, engines=2) as real:
        print(f"\n[e2e] chat + embed engines READY after {real.timings['all_ready_s']:.1f} s")
        yield real


def client(app: RealAppliance, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=app.url + "/v1", api_key=app.admin_key, timeout=timeout, max_retries=0
    )


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_status_names_each_engines_model(two_models: RealAppliance) -> None:
    engines = two_models.status()["engines"]
    assert [(e["model"], e["state"]) for e in engines] == [("chat", "READY"), ("embed", "READY")]
    listed = {m.id for m in client(two_models).models.list().data}
    assert listed == {"chat", "gpt-4o-mini", "embed"}


def test_chat_from_one_model_embeddings_from_the_other(two_models: RealAppliance) -> None:
    c = client(two_models)
    chat = c.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.model == "chat"  # the alias is served by the model it names
    assert chat.choices[0].message.content
    texts = [
        "The cat sat on the mat.",
        "A cat was sitting on the rug.",
        "Quarterly revenue rose by eight percent.",
    ]
    emb = c.embeddings.create(model="embed", input=texts)
    vectors = [d.embedding for d in emb.data]
    assert [len(v) for v in vectors] == [384, 384, 384]
    paraphrase, unrelated = cosine(vectors[0], vectors[1]), cosine(vectors[0], vectors[2])
    print(f"\n[e2e] cosine paraphrase {paraphrase:.3f}, unrelated {unrelated:.3f}")
    assert paraphrase > unrelated + 0.2
    assert emb.usage.prompt_tokens > 0


def test_a_route_the_model_does_not_serve_is_400(two_models: RealAppliance) -> None:
    c = client(two_models)
    with pytest.raises(openai.BadRequestError) as chat_on_embed:
        c.chat.completions.create(
            model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert "/v1/embeddings" in str(chat_on_embed.value)
    with pytest.raises(openai.BadRequestError) as embed_on_chat:
        c.embeddings.create(model="chat", input="hi")
    assert "/v1/chat/completions" in str(embed_on_chat.value)


def test_sigkill_of_the_embedding_engine_leaves_chat_answering(two_models: RealAppliance) -> None:
    c = client(two_models, timeout=120)
    embed_engine = next(e for e in two_models.status()["engines"] if e["model"] == "embed")
    failures: list[str] = []
    answered = 0
    stop = threading.Event()

    def chat_loop() -> None:
        nonlocal answered
        while not stop.is_set():
            try:
                r = c.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": "Count to three."}],
                    max_tokens=8,
                )
                assert r.model == "chat"
                answered += 1
            except Exception as exc:  # every failure is the test's finding
                failures.append(repr(exc))

    loop = threading.Thread(target=chat_loop, daemon=True)
    loop.start()
    try:
        os.kill(embed_engine["pid"], signal.SIGKILL)
        two_models.app.wait_for(
            lambda: two_models.engine(embed_engine["id"])["state"] != "READY",
            60,
            "the embedding engine seen down",
        )
        two_models.app.wait_for(
            lambda: two_models.engine(embed_engine["id"])["state"] == "READY",
            READY_TIMEOUT_S,
            "the embedding engine READY again",
        )
    finally:
        stop.set()
        loop.join(150)
    print(f"\n[e2e] chat answered {answered} request(s) while embed restarted")
    assert failures == []
    assert answered > 0
    emb = c.embeddings.create(model="embed", input="back again")
    assert len(emb.data[0].embedding) == 384
