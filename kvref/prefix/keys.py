"""The prefix cache's page keys: `kvref.core.page_keys`, where the page pool
that indexes pages by them can reach them without importing upward. This
module keeps the import path engines and the docs use."""

from kvref.core.page_keys import (
    DIGEST_SIZE,
    PAGE_KEY_HASHES,
    SHA256,
    ExtraKeys,
    ExtraValue,
    KeyHash,
    PageKey,
    Tokens,
    check_ids,
    encode_extras,
    iter_page_keys,
    key_hash_named,
    next_page_key,
    page_key,
    page_keys,
    token_bytes,
)

__all__ = [
    "DIGEST_SIZE", "PAGE_KEY_HASHES", "SHA256", "ExtraKeys", "ExtraValue", "KeyHash",
    "PageKey", "Tokens", "check_ids", "encode_extras", "iter_page_keys", "key_hash_named",
    "next_page_key", "page_key", "page_keys", "token_bytes",
]
