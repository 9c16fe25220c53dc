"""The paged cache's bookkeeping, without a device: which pages a sequence takes, shares, keeps cached and evicts."""
import collections

import numpy as np
import pytest

from mesh_transformer.infer.pages import Allocation, PagedCacheBook, PagePool, pages_for

PAGE = 4
SHARED = list(range(100, 100 + 2 * PAGE))  # two full pages


def state(pool: PagePool) -> tuple:
    """Everything a pool holds, to check that an operation changed nothing."""
    seqs = {s: pool.pages_of(s) for s in pool._pages}
    return list(pool.free), list(pool.cached), pool.refs.tolist(), dict(pool.name_of), seqs


def test_pages_for_rounds_up():
    assert [pages_for(n, PAGE) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocation_takes_pages_for_the_prompt_and_reserve_and_release_frees_them():
    pool = PagePool(n_pages=8, page=PAGE)
    assert pool.allocate("a", SHARED, reserve=1) == Allocation((0, 1, 2), 0)  # 8 + 1 tokens: three pages
    assert pool.available() == 5 and pool.refs.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    pool.release("a")  # never committed: nothing named, all free again
    assert pool.available() == 8 and not pool.cached and not pool.refs.any()
    with pytest.raises(KeyError, match="no live sequence 'a'"):
        pool.release("a")


def test_sequences_sharing_a_prefix_share_its_pages_and_count_references():
    pool = PagePool(n_pages=8, page=PAGE)
    pool.allocate("a", SHARED + [1])
    pool.commit("a", SHARED + [1])
    b = pool.allocate("b", SHARED + [2, 3])
    assert b == Allocation((0, 1, 3), 2 * PAGE)  # the two full pages shared, no copy; one new page for the rest
    assert pool.refs.tolist()[:4] == [2, 2, 1, 1]
    pool.release("a")
    assert pool.refs.tolist()[:4] == [1, 1, 0, 1] and list(pool.free)[-1] == 2  # a's unnamed last page is free
    pool.release("b")
    assert sorted(pool.cached) == [0, 1] and not pool.refs.any()


def test_a_cached_prefix_is_reused_after_its_sequence_ends():
    pool = PagePool(n_pages=8, page=PAGE)
    pool.allocate("a", SHARED + [1])
    pool.commit("a", SHARED + [1, 5, 6, 7])  # its decoded tokens fill its third page: named too
    pool.release("a")
    assert sorted(pool.cached) == [0, 1, 2]
    assert pool.allocate("b", SHARED + [1, 5, 6, 7, 9]) == Allocation((0, 1, 2, 3), 3 * PAGE)
    assert not pool.cached


def test_the_last_prompt_token_is_always_computed():
    pool = PagePool(n_pages=8, page=PAGE)
    pool.allocate("a", SHARED + [1])
    pool.commit("a", SHARED + [1])
    assert pool.match(SHARED) == [0]  # not both pages: the second holds the prompt's last token
    assert pool.allocate("b", SHARED) == Allocation((0, 3), PAGE)
    assert pool.match(SHARED[:1]) == []


def test_eviction_takes_the_least_recently_used_cached_pages_tail_first():
    pool = PagePool(n_pages=4, page=PAGE)
    for seq, token in (("a", 1), ("b", 2)):
        pool.allocate(seq, [token] * 2 * PAGE)
        pool.commit(seq, [token] * 2 * PAGE)
        pool.release(seq)
    assert list(pool.cached) == [1, 0, 3, 2] and not pool.free  # a's tail, a's head, b's tail, b's head
    assert pool.allocate("c", [3] * PAGE) == Allocation((1,), 0)  # a's second page evicted first
    assert pool.match([1] * 2 * PAGE + [0]) == [0]  # a's first page is still reusable
    assert pool.allocate("d", [4] * PAGE) == Allocation((0,), 0)
    assert pool.match([1] * 2 * PAGE + [0]) == [] and pool.match([2] * 2 * PAGE + [0]) == [2, 3]


def test_a_reused_cached_page_becomes_the_most_recently_used():
    pool = PagePool(n_pages=3, page=PAGE)
    for seq, token in (("a", 1), ("b", 2)):
        pool.allocate(seq, [token] * PAGE)
        pool.commit(seq, [token] * PAGE)
        pool.release(seq)
    pool.allocate("c", [1] * PAGE + [0])  # reuses a's page (the oldest), and takes the free one
    pool.release("c")
    assert list(pool.cached) == [1, 0]
    assert pool.allocate("d", [5] * 2 * PAGE) == Allocation((2, 1), 0)  # b's page evicted, not a's
    assert pool.match([1] * PAGE + [0]) == [0]


def test_allocate_returns_none_and_changes_nothing_when_pages_run_out():
    pool = PagePool(n_pages=4, page=PAGE)
    pool.allocate("a", SHARED)
    pool.commit("a", SHARED)
    pool.release("a")  # both pages cached
    pool.allocate("b", [7] * PAGE)  # takes a free page
    before = state(pool)
    # Four pages needed, one matched: three new ones, and only two can be had (one free, and the cached page not
    # reused: the reused one cannot be evicted too).
    assert pool.allocate("c", SHARED[:PAGE] + [9] * (2 * PAGE + 1)) is None
    assert state(pool) == before
    assert pool.allocate("c", [8] * (3 * PAGE + 1)) is None and state(pool) == before


def test_grow_takes_a_page_only_across_a_page_boundary():
    pool = PagePool(n_pages=3, page=PAGE)
    pool.allocate("a", [1] * (PAGE - 1))
    assert pool.grow("a", PAGE) and pool.pages_of("a") == [0]
    assert pool.grow("a", PAGE + 1) and pool.pages_of("a") == [0, 1]
    pool.allocate("b", [2])
    before = state(pool)
    assert not pool.grow("a", 2 * PAGE + 1) and state(pool) == before  # no page left: the caller preempts
    pool.release("b")
    assert pool.grow("a", 2 * PAGE + 1) and pool.pages_of("a") == [0, 1, 2]


def test_commit_refuses_more_tokens_than_the_pages_hold_or_changed_ones():
    pool = PagePool(n_pages=4, page=PAGE)
    pool.allocate("a", SHARED)
    with pytest.raises(ValueError, match="grow it first"):
        pool.commit("a", SHARED + [1] * PAGE)
    pool.commit("a", SHARED)
    with pytest.raises(ValueError, match="only ever be extended"):
        pool.commit("a", [0] + SHARED[1:])


def test_a_prefix_written_twice_keeps_the_first_page_named_and_frees_the_copy():
    pool = PagePool(n_pages=4, page=PAGE)
    pool.allocate("a", SHARED)
    pool.allocate("b", SHARED)  # admitted before a's pages were named: its own copy
    pool.commit("a", SHARED)
    pool.commit("b", SHARED)
    assert pool.name_of.keys() == {0, 1}
    pool.release("b")
    assert sorted(pool.free) == [2, 3] and pool.match(SHARED + [1]) == [0, 1]


def test_table_pads_with_an_out_of_range_page_id():
    pool = PagePool(n_pages=6, page=PAGE)
    pool.allocate("a", SHARED + [1])
    pool.allocate("b", [1])
    table = pool.table(["b", "a"], width=4)
    assert table.dtype == np.int32 and pool.pad_page == 6
    assert table.tolist() == [[3, 6, 6, 6], [0, 1, 2, 6]]
    with pytest.raises(ValueError, match="width of 2"):
        pool.table(["a"], width=2)


def test_placement_prefers_the_group_holding_the_prefix_else_the_emptiest():
    book = PagedCacheBook(n_pages=12, page=PAGE, n_groups=2)  # six pages per group
    assert book.place("a", SHARED + [1]) == (0, Allocation((0, 1, 2), 0))  # a tie: the lowest group
    assert book.place("b", [5]) == (1, Allocation((0,), 0))  # group 1 has more pages available
    book.commit("a", SHARED + [1])
    assert book.place("c", SHARED + [2]) == (0, Allocation((0, 1, 3), 2 * PAGE))  # group 0 holds the prefix
    assert book.place("d", [6] * 2 * PAGE) == (1, Allocation((1, 2), 0))
    assert book.table(["a", "d"], width=4).tolist() == [[0, 1, 2, 6], [1, 2, 6, 6]]  # ids local to each group


def test_placement_goes_elsewhere_when_the_group_holding_the_prefix_is_full():
    book = PagedCacheBook(n_pages=8, page=PAGE, n_groups=2)
    book.place("a", SHARED + [1])
    book.commit("a", SHARED + [1])
    assert book.place("b", SHARED + [2] * 2 * PAGE) == (1, Allocation((0, 1, 2, 3), 0))  # group 0 lacks 3 pages
    assert book.place("c", [3] * 5 * PAGE) is None
    assert book.group_of == {"a": 0, "b": 1}
    book.release("a")
    assert book.place("c", SHARED + [3]) == (0, Allocation((0, 1, 3), 2 * PAGE))


def check_invariants(pool: PagePool) -> None:
    """Every page is exactly one of free, cached or referenced, refcounts count the sequences holding each page, and
    the prefix index names only cached or referenced pages, one page per name."""
    free, cached = list(pool.free), list(pool.cached)
    referenced = [p for p in range(pool.n_pages) if pool.refs[p] > 0]
    assert sorted(free + cached + referenced) == list(range(pool.n_pages))
    held = collections.Counter()
    for seq in pool._pages:
        pages = pool.pages_of(seq)
        assert len(set(pages)) == len(pages)
        held.update(pages)
    assert pool.refs.tolist() == [held[p] for p in range(pool.n_pages)]
    assert not set(free) & pool.name_of.keys() and set(cached) <= pool.name_of.keys()
    assert {page: name for name, page in pool.page_of.items()} == pool.name_of


def test_random_operations_keep_every_page_accounted_for():
    rng = np.random.default_rng(0)
    pool = PagePool(n_pages=24, page=PAGE)
    kv = np.full((pool.n_pages, PAGE), -1)  # what the device would hold: the token at each page row
    prefixes = [rng.integers(0, 5, 4 * PAGE).tolist() for _ in range(3)]
    tokens: dict[int, list[int]] = {}  # per live sequence, the tokens its pages hold
    reused = refused = 0

    def write(seq: int, start: int) -> None:
        pages = pool.pages_of(seq)
        for t in range(start, len(tokens[seq])):
            page_id = pages[t // PAGE]
            assert pool.refs[page_id] == 1  # never written while shared
            kv[page_id, t % PAGE] = tokens[seq][t]

    for seq in range(600):
        op = rng.choice(["allocate", "decode", "commit", "release"], p=[0.3, 0.4, 0.15, 0.15])
        live = list(tokens)
        if op == "allocate" or not live:
            prompt = prefixes[rng.integers(3)][:rng.integers(1, 4 * PAGE + 1)] + rng.integers(0, 5, 3).tolist()
            before = state(pool)
            allocation = pool.allocate(seq, prompt, reserve=int(rng.integers(3)))
            if allocation is None:
                refused += 1
                assert state(pool) == before
            else:
                for i, page_id in enumerate(allocation.pages[:allocation.reused // PAGE]):
                    assert kv[page_id].tolist() == prompt[i * PAGE:(i + 1) * PAGE]
                assert allocation.reused < len(prompt)
                reused += allocation.reused
                tokens[seq] = prompt
                write(seq, allocation.reused)
        else:
            victim = live[rng.integers(len(live))]
            if op == "decode" and pool.grow(victim, len(tokens[victim]) + 1):
                tokens[victim].append(int(rng.integers(5)))
                write(victim, len(tokens[victim]) - 1)
            elif op == "commit":
                pool.commit(victim, tokens[victim])
            else:  # ended, or preempted as no page was left to grow it
                pool.release(victim)
                del tokens[victim]
        check_invariants(pool)
        for seq_id, seq_tokens in tokens.items():
            assert len(pool.pages_of(seq_id)) >= pages_for(len(seq_tokens), PAGE)
    assert reused > 0 and refused > 0  # the run exercised both sharing and running out
