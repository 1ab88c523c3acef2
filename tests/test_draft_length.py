"""The adaptive draft length: grows on success, shrinks on failure, pauses when nothing is accepted."""
from specedge.runtime.draft_length import DraftLength


def test_grows_after_full_accepts_and_shrinks_after_rejections():
    d = DraftLength(8)
    assert d.next() == 8
    d.update(8, 3)
    assert d.next() == 4  # just past what was accepted
    d.update(4, 4)
    assert d.next() == 6
    d.update(6, 6)
    d.update(8, 8)
    assert d.next() == 8  # never above gamma


def test_pauses_after_repeated_misses_and_backs_off_exponentially():
    d = DraftLength(4, patience=3)
    for _ in range(3):
        d.update(d.next(), 0)
    assert [d.next() for _ in range(3)] == [0, 0, 1]  # a 2-round pause, then k=1 again
    d.update(1, 0)
    for _ in range(2):
        d.update(d.next(), 0)
    assert [d.next() for _ in range(5)] == [0, 0, 0, 0, 1]  # the next pause is twice as long
    d.update(1, 1)
    d.next()
    for _ in range(3):
        d.update(d.next(), 0)
    assert [d.next() for _ in range(3)] == [0, 0, 1]  # a success resets the back-off


def test_fixed_gamma_ignores_history():
    d = DraftLength(4, adaptive=False)
    for _ in range(10):
        d.update(4, 0)
    assert d.next() == 4


def test_free_drafts_keep_gamma_but_still_pause():
    d = DraftLength(8, shrink=False, patience=2)
    d.update(8, 3)
    assert d.next() == 8
    d.update(8, 0)
    d.update(8, 0)
    assert [d.next() for _ in range(3)] == [0, 0, 8]
