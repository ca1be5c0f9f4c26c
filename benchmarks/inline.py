"""The inline write seed 001 replaces: embed the memory, then ``collection.add``, per write.

An embedded ``PersistentClient`` whose collection carries the same embedding function the
Chroma sink uses (``outbox.sinks.embedding``, MiniLM int8 ONNX), so ``add(documents=[...])``
embeds inside the call, as the original ``addMemory`` did. Also timed apart: the embedding
alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import memories, quiet_gc, summarize, time_calls
from outbox.core.keys import canonical_timestamp, idempotency_key
from outbox.sinks.embedding import load_embedding, register_with_chroma


def inline_writes(folder: Path, calls: int, warmup: int = 5) -> dict[str, Any]:
    import chromadb

    register_with_chroma()
    embedder = load_embedding("minilm")
    client = chromadb.PersistentClient(path=str(folder / "inline-chroma"))
    collection = client.get_or_create_collection(
        "inline",
        embedding_function=embedder,  # type: ignore[arg-type]
        configuration={"hnsw": {"space": "cosine"}},
    )
    texts = memories(max(calls, 50), seed=41)

    def write(number: int) -> None:
        content = f"{number} {texts[number % len(texts)]}"
        ts = canonical_timestamp()
        collection.add(
            ids=[idempotency_key(content, ts)],
            documents=[content],
            metadatas=[{"timestamp": ts, "importance": 7}],
        )

    def embed(number: int) -> None:
        embedder([f"embed {number} {texts[number % len(texts)]}"])

    time_calls(write, warmup, start=-warmup)
    with quiet_gc():
        samples, wall = time_calls(write, calls)
        embed_only = summarize(*time_calls(embed, calls))
    client.close()
    return {"inline": summarize(samples, wall), "embed_only": embed_only, "samples": samples}
