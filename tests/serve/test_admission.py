"""The paged engine's admission and preemption policy (serve/admission.py) as host logic: no device, no engine."""
import collections
import itertools

from mesh_transformer.infer.pages import PagedCacheBook
from mesh_transformer.serve.admission import admit_to_pages, compaction, make_room
from mesh_transformer.serve.completion import GenerationRequest

PAGE = 4


def request(prompt_len: int, max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(list(range(1, prompt_len + 1)), max_tokens, lambda event: None, **kw)


NUMBERS = itertools.count(1)


def admit(book, slots, waiting, resumed=(), reserve=False, n_local=4):
    waiting, resumed = collections.deque(waiting), collections.deque(resumed)
    free = [i for i, slot in enumerate(slots) if slot is None]
    placed = admit_to_pages(waiting, resumed, slots, free, n_local, book, NUMBERS, reserve)
    return placed, waiting, resumed


def held(book, slot):
    return len(book.pools[book.group_of[slot]].pages_of(slot))


def test_a_request_is_admitted_on_its_prompts_pages_unless_it_must_hold_them_all():
    """Pages for the prompt and the first decode step's key; all of prompt + max_tokens with `reserve` or with
    penalties (a prefill would restart their counts); a logit bias alone needs no more."""
    book, slots = PagedCacheBook(16, PAGE), [None] * 4
    placed, waiting, _ = admit(book, slots, [request(6, 20), request(6, 20, presence_penalty=1.0),
                                             request(6, 20, logit_bias={3: 1.0})])
    assert list(placed) == [0, 1, 2] and not waiting
    assert [held(book, i) for i in range(3)] == [2, 7, 2]  # ceil(7 / 4); ceil(26 / 4)
    assert [slots[i].reserved for i in range(3)] == [False, True, False]
    book, slots = PagedCacheBook(16, PAGE), [None] * 4
    admit(book, slots, [request(6, 20)], reserve=True)
    assert held(book, 0) == 7 and slots[0].reserved


def test_the_latest_admitted_is_preempted_when_a_group_runs_out_and_resumes_first():
    """Three requests grow in a group of 6 pages: the earliest admitted gets its page by preempting the latest (its
    pages back), which then waits ahead of every new request and is admitted again with its context when there is
    room, its tokens kept."""
    book, slots = PagedCacheBook(6, PAGE), [None] * 4
    admit(book, slots, [request(7, 20), request(3, 20), request(3, 20)])  # 2 + 1 + 1 pages
    assert [held(book, i) for i in range(3)] == [2, 1, 1]
    for i in range(3):  # each made a few tokens: the first at position 8 (a page more), the others at 4
        slots[i].tokens, slots[i].dispatched = [9], 2
    preempted = []

    def preempt(slot):
        book.release(slot)
        preempted.append(slots[slot])
        slots[slot] = None

    make_room(slots, [0, 1, 2], 4, book, preempt)  # needs 3 + 2 + 2 = 7 pages of 6
    assert [c.request.prompt for c in preempted] == [list(range(1, 4))] and slots[2] is None
    assert held(book, 0) == 3 and held(book, 1) == 2
    resumed = preempted[0]
    placed, waiting, left = admit(book, slots, [request(1, 2)], resumed=[resumed])
    assert placed == {} and len(waiting) == 1 and len(left) == 1  # one page left: the preempted one waits, and so
    # does the new one behind it (first come, first served)
    book.release(0)
    slots[0] = None
    placed, waiting, left = admit(book, slots, [request(1, 2)], resumed=[resumed])
    assert slots[0] is resumed and resumed.context == list(range(1, 4)) + [9] and not left
    assert held(book, 0) == 2  # its context of 4 and its next key
    assert list(placed) == [0, 2] and not waiting


def test_a_request_alone_among_growing_ones_that_cannot_grow_comes_back_holding_all_its_pages():
    """Beside a request holding all its pages (penalties), the one growing request that runs out preempts itself;
    it returns reserved, so it is not admitted and preempted again and again."""
    book, slots = PagedCacheBook(4, PAGE), [None] * 4
    admit(book, slots, [request(4, 8, frequency_penalty=0.5), request(3, 8)])  # 3 pages + 1
    assert held(book, 0) == 3 and held(book, 1) == 1
    slots[1].tokens, slots[1].dispatched = [5], 2  # its next key at position 4: a second page, none left
    gone = []

    def preempt(slot):
        book.release(slot)
        gone.append(slots[slot])
        slots[slot] = None

    make_room(slots, [0, 1], 4, book, preempt)
    assert len(gone) == 1 and gone[0].reserved and slots[0] is not None
    placed, _, left = admit(book, slots, [], resumed=gone)
    assert placed == {} and len(left) == 1  # it needs all 3 of its pages (context 4 + 7 more), 1 is free


def test_a_request_admitted_without_all_its_pages_leaves_a_share_of_the_group_spare():
    """Admitted on its prompt's pages, a request leaves SPARE_SHARE of its group's pages (here 2 of 200) available,
    else it waits; one that holds all its pages needs none spare."""
    book, slots = PagedCacheBook(200, PAGE), [None] * 4
    admit(book, slots, [request(4 * 196, 8, frequency_penalty=1.0)])  # 198 pages: 2 left
    placed, waiting, _ = admit(book, slots, [request(2, 8)])
    assert placed == {} and len(waiting) == 1
    placed, waiting, _ = admit(book, slots, [request(2, 1)])  # one token: only the prompt's page, nothing to grow
    assert list(placed) == [1] and held(book, 1) == 1


def test_a_slot_whose_last_token_is_in_flight_is_not_preempted_for_a_page():
    """The latest admitted slot has asked for all its tokens (it frees its pages once the last is read): the one
    before it is preempted instead."""
    book, slots = PagedCacheBook(5, PAGE), [None] * 4
    admit(book, slots, [request(7, 20), request(3, 20), request(3, 2)])  # 2 + 1 + 1 pages, 1 free
    for i, dispatched in enumerate((2, 2, 2)):
        slots[i].tokens, slots[i].dispatched = [9], dispatched  # slot 2: max_tokens 2 asked for, none to make
    assert not slots[2].needs_step
    gone = []

    def preempt(slot):
        book.release(slot)
        gone.append(slot)
        slots[slot] = None

    make_room(slots, [0, 1], 4, book, preempt)  # 3 + 2 pages wanted, 4 + the finishing slot's 1 held
    assert gone == [1] and held(book, 0) == 3 and slots[2] is not None


def test_compaction_moves_the_busy_slots_above_the_rows_that_hold_them_down_to_free_ones():
    """Per dp group of 16 slots (rows 1, 4, 16): two busy at local 9 and 14 move to 0 and 1; three busy below 4 stay;
    one busy at 3 of one alone moves to 0; an empty group, and 5 busy (16 rows hold them wherever they are), move
    none. The pages follow under the new slot (PagedCacheBook.rename), in the same group."""
    busy = object()
    slots = [None] * 80
    for i in (9, 14, 16, 17, 18, 35, 64, 66, 70, 75, 79):
        slots[i] = busy
    assert compaction(slots, 16, [1, 4, 16]) == {9: 0, 14: 1, 35: 32}
    book = PagedCacheBook(16, PAGE, n_groups=2)
    book.place(9, list(range(10)))
    pages = book.pools[0].pages_of(9)
    book.rename(9, 0)
    assert book.pools[0].pages_of(0) == pages and book.group_of == {0: 0} and 9 not in book.pools[0]
