"""The official openai and ollama clients against `metrale serve --task embed` on the default model (the engine
process, as served): `client.embeddings.create` (which asks for base64 and decodes it) equals the float form,
`dimensions` is refused on a model that is not Matryoshka-trained, Ollama's embed / embeddings, the generation
routes refused naming the task, and the prompt tokens on /metrics."""

from __future__ import annotations

import math
from contextlib import closing

import ollama
import openai
import pytest

from tests.server.serve import SMALL, ServerProcess

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]
TEXTS = ["The cat sat on the mat.", "Embeddings map text to vectors.", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--task", "embed", *SMALL) as server:
        yield server


def test_the_openai_client_gets_the_same_vectors_as_base64_and_as_floats(server):
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        packed = client.embeddings.create(model=model, input=TEXTS)  # the SDK sends encoding_format=base64
        floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
        with pytest.raises(openai.BadRequestError, match="matryoshka"):
            client.embeddings.create(model=model, input=TEXTS[0], dimensions=64)
        with pytest.raises(openai.BadRequestError, match="--task generate"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert [d.embedding for d in packed.data] == [d.embedding for d in floats.data]
    assert all(len(d.embedding) == 576 for d in packed.data)  # SmolLM2-135M's hidden size
    assert all(math.isclose(sum(x * x for x in d.embedding), 1.0, rel_tol=1e-4) for d in packed.data)
    assert packed.usage.prompt_tokens == packed.usage.total_tokens > len(TEXTS)
    similar = _cosine(packed.data[0].embedding, packed.data[0].embedding)
    assert similar == pytest.approx(1.0) and _cosine(packed.data[0].embedding, packed.data[2].embedding) < 0.999
    assert server.metric("metrale_prompt_tokens_total") >= 2 * packed.usage.prompt_tokens


def test_the_ollama_client_embeds(server):
    with closing(ollama.Client(host=server.url(""), timeout=120)) as client:
        (listed,) = client.list().models
        batch = client.embed(model=listed.model, input=TEXTS)
        one = client.embed(model=f"{listed.model}:latest", input=TEXTS[1], truncate=True)
        legacy = client.embeddings(model=listed.model, prompt=TEXTS[1])
    assert len(batch.embeddings) == 3 and batch.prompt_eval_count > len(TEXTS)
    assert one.embeddings[0] == pytest.approx(batch.embeddings[1], abs=1e-5)  # alone or batched
    norm = math.sqrt(sum(x * x for x in legacy.embedding))
    assert [x / norm for x in legacy.embedding] == pytest.approx(one.embeddings[0], abs=1e-5)


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
