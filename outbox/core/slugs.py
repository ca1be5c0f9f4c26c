"""Markdown file names: supplied and derived slugs, length caps.

Pure functions: the same (content, instant, slug) always gives the same name, which is what
stops a retried write from leaving a second file.
"""

from __future__ import annotations

import re

from outbox.core.keys import content_hash_prefix

MAX_TOKEN_BYTES = 100
_HYPHENS = re.compile(r"-{2,}")


def _keep_slug_chars(text: str) -> str:
    if text.isalnum():  # most words: nothing to drop, and far cheaper than the scan
        return text
    return "".join(ch for ch in text if ch == "-" or ch.isalnum())


def _cut_utf8(text: str, limit: int = MAX_TOKEN_BYTES) -> str:
    """Cut to at most ``limit`` UTF-8 bytes at a character boundary, trailing hyphens stripped."""
    encoded = text.encode("utf-8")
    if len(encoded) > limit:
        text = encoded[:limit].decode("utf-8", errors="ignore")
    return text.rstrip("-")


def sanitize_slug(supplied: str) -> str:
    """A caller's slug made safe: lowercase, spaces to hyphens, letters/digits/hyphens only.

    Returns "" when nothing is left, so the caller derives one from the content instead.
    """
    text = supplied.lower().replace(" ", "-")
    text = _HYPHENS.sub("-", _keep_slug_chars(text)).strip("-")
    return _cut_utf8(text)


def _strip_token(token: str) -> str:
    start, end = 0, len(token)
    while start < end and not token[start].isalnum():
        start += 1
    while end > start and not token[end - 1].isalnum():
        end -= 1
    return token[start:end]


def content_tokens(content: str, limit: int = 8) -> list[str]:
    """The first ``limit`` cleaned whitespace-separated tokens of the content."""
    tokens: list[str] = []
    for raw in content.split():
        token = _keep_slug_chars(_strip_token(raw).lower())
        if token:
            tokens.append(token)
            if len(tokens) == limit:
                break
    return tokens


def derive_slug(content: str) -> str:
    """``<first-8-tokens>-<hash-prefix>``, or the hash prefix alone when there are no tokens."""
    prefix = content_hash_prefix(content)
    token_part = _cut_utf8("-".join(content_tokens(content)))
    return f"{token_part}-{prefix}" if token_part else prefix


def carries_content_hash(slug: str, content: str) -> bool:
    """Whether ``slug`` ends with its content's hash prefix, as every derived slug does:
    then no file made by a person or for other content has its name by chance."""
    return slug.endswith(content_hash_prefix(content))


def choose_slug(content: str, supplied: str | None = None) -> str:
    """The supplied slug when it survives sanitising, else the derived one."""
    if supplied:
        cleaned = sanitize_slug(supplied)
        if cleaned:
            return cleaned
    return derive_slug(content)


def markdown_filename(canonical_ts: str, slug: str, collision_key: str | None = None) -> str:
    """``<YYYY-MM-DD>-<slug>.md``; with ``collision_key`` the name gets ``-<8 hex of key>``."""
    date = canonical_ts[:10]
    suffix = f"-{collision_key[:8]}" if collision_key else ""
    return f"{date}-{slug}{suffix}.md"
