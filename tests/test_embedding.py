"""The offline MiniLM embedding: shape, determinism, batching, truncation, file checks, and
that Chroma accepts it as an embedding function (and rebuilds it without reloading)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from outbox import load_settings
from outbox.core.errors import ConfigError
from outbox.sinks.chroma_documents import has_visible_text
from outbox.sinks.embedding import (
    DIMENSION,
    EmbeddingError,
    HashingEmbedding,
    MiniLMEmbedding,
    default_tokenizer_path,
    embedding_name,
    load_embedding,
    register_with_chroma,
)

TEXTS = [
    "Deploys wait for the schema migration before the web workers start.",
    "Alice wants short answers: code first, explanation after.",
    "ok",
    "The nightly backfill keeps both CPU cores busy for about forty minutes, so schedule heavy "
    "jobs elsewhere and never run the benchmark suite while it is active on the build host.",
    "Ünïcödé, emoji 👍 and 日本語 all go through the same tokenizer.",
    "",
]


@pytest.fixture(scope="module")
def minilm() -> MiniLMEmbedding:
    embedder = load_embedding("minilm")
    assert isinstance(embedder, MiniLMEmbedding)
    return embedder


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_vectors_are_384d_unit_norm_and_deterministic(minilm: MiniLMEmbedding) -> None:
    first = minilm(TEXTS)
    second = minilm(list(reversed(TEXTS)))[::-1]
    assert len(first) == len(TEXTS)
    for a, b in zip(first, second, strict=True):
        assert a.shape == (DIMENSION,)
        assert a.dtype == np.float32
        assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-4
        assert np.allclose(a, b, atol=1e-6)
    assert cosine(first[0], first[1]) < 0.9, "different texts must not collapse to one vector"


def test_batch_gives_the_same_vectors_as_singles(minilm: MiniLMEmbedding) -> None:
    texts = [f"{text} (variant {i})" for i in range(12) for text in TEXTS[:5]]
    batch = minilm(texts)
    singles = [minilm([text])[0] for text in texts]
    assert min(cosine(a, b) for a, b in zip(batch, singles, strict=True)) > 0.999


def test_long_text_is_truncated_at_256_tokens(minilm: MiniLMEmbedding) -> None:
    long = " ".join(f"word{i}" for i in range(400))
    (a, b) = minilm([long, long + " and a different ending that lies past the limit"])
    assert np.allclose(a, b, atol=1e-6)
    (short,) = minilm(["word0 word1 word2"])
    assert cosine(a, short) < 0.99


def test_the_instance_is_shared_and_build_from_config_is_memoised(
    minilm: MiniLMEmbedding,
) -> None:
    assert load_embedding() is minilm
    assert MiniLMEmbedding.build_from_config(minilm.get_config()) is minilm
    assert MiniLMEmbedding.build_from_config({}) is minilm


def test_corrupted_tokenizer_fails_its_checksum(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    shutil.copyfile(default_tokenizer_path(), good)
    assert MiniLMEmbedding(tokenizer_path=good)(["still works"])[0].shape == (DIMENSION,)
    bad = tmp_path / "tokenizer.json"
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    with pytest.raises(EmbeddingError, match="SHA-256") as caught:
        MiniLMEmbedding(tokenizer_path=bad)
    assert not isinstance(caught.value, ValueError), "must stay retryable for the dispatcher"
    with pytest.raises(EmbeddingError, match="cannot read"):
        MiniLMEmbedding(tokenizer_path=tmp_path / "missing.json")


def test_invisible_content_is_exactly_what_the_tokenizer_drops(minilm: MiniLMEmbedding) -> None:
    invisible = ["\u200b\u2060\ufeff", "\u0301", "\ufffd\ufffd", " \u00a0\u3000\t", "\x01\x7f"]
    visible = ["a", "é", "日本", "👍", "42", "-"]
    (empty,) = minilm([""])
    for text in invisible:
        assert not has_visible_text(text)
        assert minilm._tokenizer.encode(text).ids == [101, 102]  # [CLS] [SEP] only
        assert cosine(minilm([text])[0], empty) > 0.9999
    for text in visible:
        assert has_visible_text(text)
        assert len(minilm._tokenizer.encode(text).ids) > 2


def test_import_stays_cheap() -> None:
    code = (
        "import sys, outbox.sinks.embedding, outbox.sinks.chroma;"
        "print(sorted(m for m in ('chromadb', 'onnxruntime', 'tokenizers', 'numpy')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_hashing_is_explicit_deterministic_and_lexical() -> None:
    hashing = load_embedding("hashing")
    assert isinstance(hashing, HashingEmbedding)
    a, b, none = hashing(["the cat sat", "the cat sat", "!!! ???"])
    assert np.array_equal(a, b)
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5
    assert not none.any(), "no words: the zero vector, which the sink refuses"
    assert embedding_name(hashing) != embedding_name(load_embedding("minilm"))


def test_embedding_setting_names_an_embedder() -> None:
    assert load_embedding("tests.test_embedding:Constant")(["x"]) == [[1.0, 0.0]]
    assert load_embedding("tests.test_embedding:Constant") is load_embedding(
        "tests.test_embedding:Constant"
    )
    with pytest.raises(ConfigError, match="OUTBOX_EMBEDDING"):
        load_embedding("tests.test_embedding:Missing")
    with pytest.raises(ConfigError, match="OUTBOX_EMBEDDING"):
        load_embedding("word2vec")
    with pytest.raises(ConfigError, match="OUTBOX_EMBEDDING"):
        load_settings(env={"OUTBOX_EMBEDDING": "word2vec"})
    assert load_settings(env={}).embedding == "minilm"


class Constant:
    """A legacy-style embedding function (no name()): allowed through module:attr."""

    def __call__(self, input: list[str]) -> list[list[float]]:
        return [[1.0, 0.0] for _ in input]


def test_chroma_takes_it_as_its_embedding_function(tmp_path: Path, minilm: MiniLMEmbedding) -> None:
    import chromadb

    register_with_chroma()
    docs = {
        "db": "We store the outbox in SQLite with write-ahead logging.",
        "food": "Bob is allergic to peanuts; order the pad thai without them.",
        "deploy": "Production releases go out on Tuesdays after the change review.",
    }
    client: Any = chromadb.PersistentClient(str(tmp_path / "chroma"))
    with client:
        collection = client.create_collection("ef-test", embedding_function=minilm)
        collection.add(ids=list(docs), documents=list(docs.values()))
        reopened = client.get_collection("ef-test")  # no function given: rebuilt from config
        assert reopened.configuration.get("embedding_function") is minilm
        hits = reopened.query(query_texts=["which nut must Bob avoid"], n_results=1)
        assert hits["ids"][0] == ["food"]
