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


def test_tree_choice_follows_tokens_per_second():
    from specedge.runtime.draft_length import TreeChoice

    fixed = TreeChoice(adaptive=False)
    assert all(fixed.use_tree() for _ in range(40))
    choice = TreeChoice(explore=10)
    assert choice.use_tree() is True  # measure a tree round first
    choice.update(True, 2, 0.020)  # 100 tokens/s
    assert choice.use_tree() is False  # then a chain round
    choice.update(False, 2, 0.010)  # 200 tokens/s: chains are worth more
    picks = []
    for _ in range(40):
        picks.append(choice.use_tree())
        choice.update(picks[-1], 2, 0.020 if picks[-1] else 0.010)
    assert 2 <= sum(picks) <= 5  # trees only as the periodic exploration
    for _ in range(40):  # the text changes: trees now commit 3x the tokens per round at the same cost
        tree = choice.use_tree()
        choice.update(tree, 6 if tree else 2, 0.010)
    picks = [choice.use_tree() for _ in range(20)]
    assert sum(picks) >= 17


def test_rate_choice_measures_every_option_then_runs_the_best_and_explores_the_others():
    from specedge.runtime.draft_length import RateChoice

    assert RateChoice((None, 1, 0), adaptive=False).choose() is None
    choice = RateChoice((None, 1, 0), explore=8)
    worth = {None: 150.0, 1: 250.0, 0: 200.0}  # tokens per second of each kind of round
    picks = []
    for _ in range(80):
        picks.append(choice.choose())
        choice.update(picks[-1], 3, 3 / worth[picks[-1]])
    assert picks[:3] == [None, 1, 0]
    assert picks.count(1) >= 65  # the best
    assert picks[3:].count(None) >= 2 and picks[3:].count(0) >= 2  # each other option is re-measured
