"""PagePool bookkeeping: allocation, prefix hits, reference counts, LRU eviction of cached pages."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from appliance.engine.kv_cache import PagePool, PageTable
from appliance.engine.request import Request, SamplingParams, TokenView

S = 4


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_allocate_grow_free_roundtrip():
    pool = PagePool(8, S)
    t = PageTable()
    assert pool.allocate(t, tokens(10), 10) == 0
    assert len(t.pages) == 3 and pool.num_free_pages == 5
    assert pool.grow(t, 12) and len(t.pages) == 3  # still fits
    assert pool.grow(t, 13) and len(t.pages) == 4
    pool.free(t)
    assert pool.num_free_pages == 8 and t.pages == []


def test_prefix_hit_shares_pages_and_refcounts():
    pool = PagePool(8, S)
    a = PageTable()
    pool.allocate(a, tokens(9), 9)
    pool.register(a, tokens(9), 9)  # two full pages cached
    assert pool.num_cached_pages == 2
    b = PageTable()
    prompt_b = tokens(8) + [99, 98, 97]
    assert pool.allocate(b, prompt_b, 11) == 8
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    pool.free(a)
    # the shared pages are still held by b
    assert pool.num_free_pages == 8 - 3
    pool.free(b)
    assert pool.num_free_pages == 8 and pool.num_cached_pages == 2


def test_full_hit_still_computes_the_last_token():
    pool = PagePool(8, S)
    a = PageTable()
    pool.allocate(a, tokens(8), 8)
    pool.register(a, tokens(8), 8)
    pool.free(a)
    b = PageTable()
    assert pool.allocate(b, tokens(8), 8) == 4  # second page recomputed so the last token yields logits


def test_short_pool_changes_nothing():
    pool = PagePool(3, S)
    t = PageTable()
    assert pool.allocate(t, tokens(13), 13) is None
    assert t.pages == [] and pool.num_free_pages == 3


def test_lru_eviction_prefers_least_recently_freed_and_tail_pages():
    pool = PagePool(4, S)
    a, b = PageTable(), PageTable()
    pool.allocate(a, tokens(8, 0), 8)
    pool.register(a, tokens(8, 0), 8)
    pool.allocate(b, tokens(8, 100), 8)
    pool.register(b, tokens(8, 100), 8)
    pool.free(a)
    pool.free(b)
    assert pool.num_cached_pages == 4
    c = PageTable()
    pool.allocate(c, tokens(4, 500), 4)  # takes a's tail page (freed first, tail first)
    assert len(pool.cached_prefix(tokens(8, 100) + [1], 9)) == 2  # b untouched
    assert len(pool.cached_prefix(tokens(8, 0) + [1], 9)) == 1


def test_duplicate_content_keeps_one_cached_copy():
    pool = PagePool(8, S)
    a, b = PageTable(), PageTable()
    pool.allocate(a, tokens(5), 5)
    pool.allocate(b, tokens(5), 5)  # admitted together: neither is cached yet
    pool.register(a, tokens(5), 5)
    pool.register(b, tokens(5), 5)
    assert pool.num_cached_pages == 1
    pool.free(a)
    pool.free(b)
    assert pool.num_free_pages == 8


def test_prefix_caching_off():
    pool = PagePool(8, S, enable_prefix_caching=False)
    a = PageTable()
    pool.allocate(a, tokens(9), 9)
    pool.register(a, tokens(9), 9)
    pool.free(a)
    assert pool.num_cached_pages == 0 and pool.allocate(PageTable(), tokens(9), 9) == 0


def test_a_salted_table_shares_pages_only_with_its_salt():
    pool = PagePool(16, S)
    salted = PageTable()
    salted.salt("tenant-a")
    pool.allocate(salted, tokens(9), 9)
    pool.register(salted, tokens(9), 9)
    plain, other, same = PageTable(), PageTable(), PageTable()
    other.salt("tenant-b")
    same.salt("tenant-a")
    assert pool.allocate(plain, tokens(9), 9) == 0 and pool.allocate(other, tokens(9), 9) == 0
    assert pool.allocate(same, tokens(9), 9) == 8 and same.pages[:2] == salted.pages[:2]
    pool.free(same)
    assert same.root == salted.root  # a preempted request keeps its salt for its next admission


@given(st.lists(st.integers(0, 99), max_size=20), st.lists(st.integers(0, 99), max_size=20),
       st.integers(-25, 45), st.integers(-25, 45), st.sampled_from([None, 1, 2, -1]))
def test_a_request_s_tokens_read_as_the_joined_list(prompt, output, start, stop, step):
    """A request's prompt + output are read in place (the prefix cache hashes a long context's new pages without
    joining the two lists each time): length, slices and items as the joined list's."""
    view, joined = TokenView(prompt, output), prompt + output
    assert len(view) == len(joined) and list(view) == joined
    assert view[start:stop:step] == joined[start:stop:step]
    if -len(joined) <= start < len(joined):
        assert view[start] == joined[start]


def test_registering_a_request_s_pages_through_its_view_caches_what_the_list_would():
    pool = PagePool(64, 4)
    tokens = list(range(30))
    r = Request("a", tokens[:18], SamplingParams(max_tokens=20))
    r.output_token_ids.extend(tokens[18:])
    table = PageTable()
    assert pool.allocate(table, r.all_token_ids, len(tokens)) == 0
    pool.register(table, r.all_token_ids, len(tokens))
    again = PageTable()
    assert pool.allocate(again, tokens, len(tokens)) == 28  # seven full pages shared; one token left to compute
