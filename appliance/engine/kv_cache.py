"""The paged KV cache: the tensor that holds every layer's K/V pages, and the page pool that hands pages to requests.

The pool keeps a free list, a block table per request, and a prefix cache: every full page is keyed by a hash chain
of the token ids up to its end; a new request reuses the longest cached chain; pages are reference-counted, and cached
pages nobody references stay reusable until evicted, least recently freed first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from appliance.model_zoo.config import ModelConfig


class KVCache:
    """One tensor [layers, 2 (K, V), pages + 1, page_size, kv_heads, head_dim] holding every layer's pages.

    The last page is scratch, never handed out by the pool: padded rows of a CUDA-graph batch write and read it.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch_page = num_pages
        # empty on a CPU: attention never reads a slot before writing it, and zeroing a large cache would touch every
        # page of it at start-up; zeros on a GPU (milliseconds), where benchmarks take a context as computed without
        # writing it (`muxd bench engine` fills rank 0's with random values, the other ranks' stay zero)
        self.data = torch.empty(cfg.num_layers, 2, num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device)
        if self.data.is_cuda:
            self.data.zero_()

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return cfg.num_layers * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * elem


@dataclass
class PageTable:
    """A request's pages in order, and the hash chain of its full pages as far as it has been computed."""

    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0  # leading pages already entered in (or found in) the prefix cache
    root: bytes = b""  # where the chain starts: a request's cache salt, so that only requests of that salt share

    def salt(self, text: str) -> None:
        """Chain this table's pages from `text` (vLLM's cache_salt): other requests cannot find them, nor time them."""
        self.root = hashlib.blake2b(b"salt\0" + text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _page_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PagePool:
    """Hands out fixed-size pages; shares full pages between requests with equal prefixes."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"page pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_pages
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first

    # ---- accounting -------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages a new request could get: never used, or cached but referenced by nobody."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_of)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache -----------------------------------------------------------------------------------------
    def _extend_hashes(self, table: PageTable, token_ids: Sequence[int], num_tokens: int) -> None:
        size = self.page_size
        # (a request whose latest token is still on the device counts it in num_tokens: only known tokens hash)
        for i in range(len(table.hashes), min(num_tokens, len(token_ids)) // size):
            parent = table.hashes[-1] if table.hashes else table.root
            table.hashes.append(_page_hash(parent, token_ids[i * size:(i + 1) * size]))

    def _lookup(self, token_ids: Sequence[int], num_tokens: int,
                table: PageTable | None = None) -> tuple[list[bytes], list[int]]:
        """Hash chain of the full pages of token_ids[:num_tokens - 1] and the cached pages of its longest prefix
        (at least one token is always left to compute, so the request gets logits). The hashes are kept on `table`
        (a request's table without pages), so a request that waits is hashed once."""
        if not self.enable_prefix_caching:
            return [], []
        table = table if table is not None else PageTable()
        self._extend_hashes(table, token_ids, num_tokens - 1)
        hashes = table.hashes[:(num_tokens - 1) // self.page_size]
        hit = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            hit.append(page)
        return hashes, hit

    def cached_prefix(self, token_ids: Sequence[int], num_tokens: int, table: PageTable | None = None) -> list[int]:
        """Pages holding the longest cached prefix of token_ids[:num_tokens], leaving at least one token to compute."""
        return self._lookup(token_ids, num_tokens, table)[1]

    # ---- allocation -------------------------------------------------------------------------------------------
    def allocate(self, table: PageTable, token_ids: Sequence[int], num_tokens: int, reuse: bool = True) -> int | None:
        """Give an empty table pages for num_tokens tokens, reusing cached prefix pages (unless `reuse` is off: a
        request that must compute every token).

        Returns the number of tokens whose KV is already cached, or None (nothing changed) when the pool is short.
        """
        assert not table.pages, "allocate() takes a request without pages"
        hashes, hit = self._lookup(token_ids, num_tokens, table) if reuse else ([], [])
        needed = self.pages_for(num_tokens) - len(hit)
        reclaimable = self.num_free_pages - sum(1 for p in hit if p in self._evictable)
        if needed > reclaimable:
            return None
        for page in hit:
            if self._refcount[page] == 0:
                del self._evictable[page]
            self._refcount[page] += 1
        table.pages = hit + [self._take_page() for _ in range(needed)]
        table.hashes = hashes  # kept for register(): these pages' hashes need not be computed again
        table.num_registered = len(hit)
        return len(hit) * self.page_size

    def grow(self, table: PageTable, num_tokens: int) -> bool:
        """Make room for num_tokens tokens in total (one more page at most per call); False if the pool is empty."""
        if -(-num_tokens // self.page_size) <= len(table.pages):  # (pages_for, inline: once a row a step)
            return True
        if self.num_free_pages == 0:
            return False
        table.pages.append(self._take_page())
        return True

    def register(self, table: PageTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Enter the table's pages that are full and fully computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(table, token_ids, num_computed)
        full = min(num_computed // self.page_size, len(table.hashes))
        for i in range(table.num_registered, full):
            page, h = table.pages[i], table.hashes[i]
            if self._hash_of[page] is None and h not in self._page_of:
                self._hash_of[page] = h
                self._page_of[h] = page
        table.num_registered = max(table.num_registered, full)

    def free(self, table: PageTable) -> None:
        """Drop the table's references; unreferenced cached pages stay reusable, tail pages evicted first."""
        for page in reversed(table.pages):
            self._refcount[page] -= 1
            assert self._refcount[page] >= 0, f"page {page} freed twice"
            if self._refcount[page] == 0:
                if self._hash_of[page] is not None:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        table.pages, table.hashes, table.num_registered = [], [], 0

    def _take_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of[page]]  # type: ignore[arg-type]
            self._hash_of[page] = None
        self._refcount[page] = 1
        return page
