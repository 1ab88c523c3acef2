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


def test_draft_acceptance_is_the_rate_of_a_geometric_length_cut_at_what_was_proposed():
    from specedge.runtime.draft_length import Acceptance, DraftLength

    acceptance = Acceptance(decay=0.5)
    assert acceptance.rate == 0.5  # the prior: one acceptance, one rejection
    acceptance.update(4, 4)  # all accepted: no rejection seen
    assert acceptance.rate == (0.5 + 4) / (0.5 + 4 + 0.5)
    acceptance.update(4, 1)
    assert acceptance.rate == (2.25 + 1) / (2.25 + 1 + 1.25)
    acceptance.update(0, 0)  # no proposal: nothing learned
    assert acceptance.rate == (2.25 + 1) / (2.25 + 1 + 1.25)
    for _ in range(3):
        acceptance.update(4, 0)
    low = acceptance.rate
    for _ in range(30):  # drafts cut by a batch's step width: back toward the prior, to be tried again
        acceptance.unverified()
    assert low < 0.3 and abs(acceptance.rate - 0.5) < 1e-3
    length = DraftLength(4, adaptive=False)  # a row's draft length keeps one, whether adaptive or not
    length.update(4, 0)
    assert length.acceptance.rate == 0.9 / (0.9 + 1.9)


def test_step_width_picks_the_width_whose_expected_tokens_per_second_is_highest():
    from specedge.runtime.draft_length import StepWidth

    width = StepWidth([1, 2, 3, 5])
    seconds = {1: 0.036, 2: 0.060, 3: 0.065, 5: 0.090}  # a batch-4 float32 step at one bucket
    for t, s in seconds.items():
        for _ in range(4):
            width.update(256, t, s)
    width.update(256, 1, 0.5)  # one slow outlier: the median ignores it
    assert width.seconds(256, 1) == 0.036
    recent = StepWidth([1])
    for s in [0.010] * 5 + [0.020] * 3:  # the last five rounds count
        recent.update(128, 1, s)
    assert recent.seconds(128, 1) == 0.020
    assert StepWidth.expected_tokens(0, 0.7) == 1 and StepWidth.expected_tokens(2, 0.5) == 1.75
    # four rows with four drafts each: tokens per second 111 (T=1), 113, 135 (T=3), 123 (T=5) at 70%
    assert width.choose([(4, 0.7, 100)] * 4, 256) == 3
    assert width.choose([(4, 0.9, 100)] * 4, 256) == 5
    assert width.choose([(4, 0.2, 100)] * 4, 256) == 1  # drafts that rarely hold do not pay for a wider step
    assert width.choose([(0, 0.9, 100)] * 4, 256) == 1  # nothing to verify
    assert width.choose([(1, 0.9, 100)] * 4, 256) == 2  # no wider than the longest proposal + 1
    assert width.choose([(4, 0.2, 100)] * 4, 256, least=3) == 3  # a row with a fixed length needs T=3
    assert width.choose([(4, 0.9, 100)] * 4, 256, most=3) == 3  # what fits the cache
    # a bucket where nothing was timed: the plain step until it is trusted (3 rounds), then a wider step is
    # guessed as cheap as the widest narrower one trusted, so it is tried where it could pay
    good = [(4, 0.7, 100)] * 4
    for _ in range(3):
        assert width.choose(good, 384) == 1
        width.update(384, 1, 0.040)
    assert width.choose(good, 384) == 5
    # one slow first round (a shared machine) does not rule a width out: it is timed until trusted
    width.update(384, 5, 0.500)
    assert width.seconds(384, 5) == 0.040 and width.choose(good, 384) == 5
    width.update(384, 5, 0.100)
    width.update(384, 5, 0.100)
    assert width.seconds(384, 5) == 0.100 and width.seconds(384, 3) == 0.040 and width.choose(good, 384) == 3
    for _ in range(3):
        width.update(384, 3, 0.120)  # dearer than the wider T=5 measured: noise, capped at T=5's cost
    assert width.seconds(384, 3) == 0.100
    # a width not run for `stale` rounds of its bucket is forgotten and timed again (the load changes)
    aging = StepWidth([1, 5], stale=10)
    for _ in range(3):
        aging.update(128, 5, 0.500)
    for _ in range(10):
        aging.update(128, 1, 0.040)
    assert aging.choose(good, 128) == 1 and aging.seconds(128, 5) == 0.500
    aging.update(128, 1, 0.040)
    assert aging.seconds(128, 5) == 0.040 and aging.choose(good, 128) == 5
    # closed: three rows almost done and one slow row with most of its tokens left. Tokens per second favour
    # T=5 (the three rows' drafts hold); the slow row finishes soonest at T=1, and it decides when all do.
    rows = [(4, 0.9, 20)] * 3 + [(4, 0.1, 100)]
    assert width.choose(rows, 256) == 5
    assert width.choose(rows, 256, closed=True) == 1
    assert width.choose([(4, 0.9, 100)] * 4, 256, closed=True) == 5  # every row gains: as wide as pays
