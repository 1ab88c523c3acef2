"""Token trees in the loop: one verify step checks a chain plus alternatives, and greedy output still equals
plain decode token for token; an accepted node off the first chain lands in the right cache slot."""
import numpy as np
import pytest
from conftest import CHUNK
from models import make_hf_model

from specedge.errors import GenerationError
from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime.generator import Generator
from specedge.runtime.proposers import NgramProposer, Proposal, match_starts, ngram_lookup, ngram_tree
from specedge.runtime.tree import TreeLayout, spine_length, spine_plus_leaves

NEW = 40
TREES = ((8, 4), (16, 8))  # (tree T, gamma)


def prompt_of(length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    head = rng.integers(2, 1000, (length + 1) // 2).tolist()
    return (head + head)[:length]


@pytest.fixture(scope="module")
def tree_gens(tiny_models, tiny_near_draft_model, tmp_path_factory):
    """The tiny llama with a layer draft, and with a separate draft model; both with tree graphs 8 and 16."""
    root = tmp_path_factory.mktemp("tree_bundles")
    hf = tiny_models["llama"][0]
    export_bundle(hf, str(root / "layer"), ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                         tree_sizes=(8, 16)), progress=False)
    export_bundle(hf, str(root / "pair"), ExportOptions(context=128, prefill_chunk=CHUNK, tree_sizes=(8, 16)),
                  draft_path=tiny_near_draft_model[0], progress=False)
    gens = {name: Generator.load(str(root / name)) for name in ("layer", "pair")}
    yield gens
    for g in gens.values():
        g.close()


def test_tree_layout_depths_and_visibility():
    # root -> 0 -> 1 -> 2 (the chain), leaves 3 (beside 0) and 4 (beside 2)
    layout = TreeLayout.build(7, [10, 11, 12, 13, 14], [0, 1, 2, 0, 2])
    assert layout.tokens == [7, 10, 11, 12, 13, 14]
    assert layout.depth.tolist() == [0, 1, 2, 3, 1, 3]
    assert layout.sees[5].tolist() == [True, True, True, False, False, True]  # root, 0, 1, itself
    assert layout.sees[4].tolist() == [True, False, False, False, True, False]
    assert spine_length([0, 1, 2, 0, 2]) == 3 and spine_plus_leaves([0, 1, 2, 0, 2])
    assert not spine_plus_leaves([0, 1, 0, 3])  # a child of a leaf
    with pytest.raises(ValueError):
        TreeLayout.build(7, [1, 2], [0, 2])


def test_ngram_tree_spine_is_the_chain_and_leaves_are_other_matches():
    a, b = 5, 6
    #           [a b 20 21] ... [a b 30 31] ... [a b 40] ... a b
    context = np.array([a, b, 20, 21, 7, a, b, 30, 31, 8, a, b, 40, 9, a, b])
    tokens, parents = ngram_tree(context, 3, 7, 2, 4)
    assert tokens[:3] == [40, 9, a] and parents[:3] == [0, 1, 2]  # the most recent match, as a chain
    assert tokens[:3] == ngram_lookup(context, 3, 2, 4)  # the chain proposer's own proposal
    leaves = list(zip(tokens[3:], parents[3:]))
    assert (30, 0) in leaves and (20, 0) in leaves  # the older matches' first tokens, beside 40
    assert spine_plus_leaves(parents) and len(tokens) <= 7
    tokens, parents = ngram_tree(context, 3, 4, 2, 4)  # the node budget cuts leaves, never the chain
    assert len(tokens) == 4 and tokens[:3] == [40, 9, a]
    chained, _ = ngram_tree(np.array([1, 2, 3, 1, 2]), 6, 6, 2, 4)
    assert chained == [3, 1, 2, 3, 1, 2]  # a continuation that runs into the end is looked up again


def test_prompt_lookup_prefers_the_longest_suffix_and_chains_its_continuation():
    lookup = NgramProposer()  # the default suffix sizes
    # The last 5 tokens occurred once, followed by 50; their last 4 also occurred later, followed by 60.
    context = [9, 1, 2, 3, 4, 50, 51, 7, 1, 2, 3, 4, 60, 61, 7, 9, 1, 2, 3, 4]
    assert lookup.propose(context, 2, None).tokens == [50, 51]
    assert NgramProposer(2, 4).propose(context, 2, None).tokens == [60, 61]  # 4 tokens: the most recent match
    # A continuation that runs into the end of the context is looked up again, up to k tokens.
    assert ngram_lookup(np.array([1, 2, 3, 1, 2]), 6, 2, 8) == [3, 1, 2]
    assert lookup.propose([1, 2, 3, 1, 2], 6, None).tokens == [3, 1, 2, 3, 1, 2]
    assert lookup.propose([1, 2, 3, 1, 2], 6, None).tokens == ngram_tree(np.array([1, 2, 3, 1, 2]), 6, 6, 2, 8)[0]
    assert lookup.propose([1, 2, 3, 4], 6, None).tokens == []  # no suffix seen before: nothing to propose


def test_match_starts_follows_its_definition_on_random_contexts():
    """The definition, spelled out: for n = n_max down to n_min, every earlier window of n tokens (never the
    suffix itself) equal to the last n, most recent first; yield where its continuation starts."""
    def by_definition(context, n_min, n_max):
        out = []
        for n in range(min(n_max, len(context) - 1), n_min - 1, -1):
            suffix = list(context[len(context) - n:])
            out += [s + n for s in range(len(context) - 1 - n, -1, -1) if list(context[s:s + n]) == suffix]
        return out

    rng = np.random.default_rng(7)
    found = 0
    for _ in range(3000):
        context = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 30)))
        n_min = int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 7))
        expected = by_definition(context, n_min, n_max)
        assert list(match_starts(context, n_min, n_max)) == expected, (context.tolist(), n_min, n_max)
        found += bool(expected)
    assert found > 1000  # the contexts did repeat themselves


def few_symbols(length: int, seed: int) -> list[int]:
    """Random text over 6 symbols: every suffix recurs with several continuations, so prompt lookup finds
    alternatives to branch on."""
    return np.random.default_rng(seed).integers(2, 8, length).tolist()


@pytest.mark.parametrize("tree,gamma", TREES)
def test_greedy_tree_speculation_equals_plain_decode(tree_gens, tree, gamma):
    totals = {}
    for seed in range(4):
        prompt = (prompt_of if seed % 2 else few_symbols)(3 * CHUNK + 5, seed=seed)
        for name, g in tree_gens.items():
            plain = g.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
            for proposer in ("ngram", "draft"):
                out = g.generate(prompt, NEW, proposer=proposer, gamma=gamma, tree=tree, stop_ids=[], adaptive=False)
                assert out.tokens == plain, (name, proposer, seed)
                # adaptive: the draft length and the tree-or-chain choice follow past rounds; same output
                assert g.generate(prompt, NEW, proposer=proposer, gamma=gamma, tree=tree, stop_ids=[]).tokens == plain
                t = totals.setdefault((name, proposer), np.zeros(4, int))
                t += [out.stats.tree_rounds, out.stats.off_chain_accepted, out.stats.accepted,
                      out.stats.proposed - out.stats.accepted]
    for (name, proposer), (rounds, off_chain, accepted, rejected) in totals.items():
        assert rounds > 0 and accepted > 0 and rejected > 0, (name, proposer)
        if proposer == "draft":  # the draft's second candidates are accepted now and then
            assert off_chain > 0, name


class TreeScript:
    """Proposes a spine of the plain output with one token wrong at depth `wrong`, and the right token as
    a leaf beside it: every round must accept the leaf, so its entries must move to the right slot."""

    name = "ngram"

    def __init__(self, prompt_len: int, reference: list[int], wrong: int, vocab: int):
        self.prompt_len, self.reference, self.wrong, self.vocab = prompt_len, reference, wrong, vocab
        self.rounds = 0

    def start(self, prompt, reuse=False):
        pass

    def propose(self, context, k, sampler):
        return Proposal([], None)

    def propose_tree(self, context, k, nodes, sampler):
        done = len(context) - self.prompt_len
        spine = list(self.reference[done:done + k])
        if len(spine) <= self.wrong:
            return Proposal(spine, None)
        right = spine[self.wrong]
        spine[self.wrong] = (right + 1) % self.vocab
        self.rounds += 1
        return Proposal(spine + [right], None, list(range(len(spine))) + [self.wrong])

    def commit(self, n_accepted, next_token, leaf=None):
        pass


@pytest.mark.parametrize("wrong", [0, 2, 5])
def test_an_accepted_leaf_is_committed_at_its_depth(tree_gens, wrong):
    g = tree_gens["layer"]
    prompt = prompt_of(21, seed=9)
    reference = g.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    script = TreeScript(len(prompt), reference, wrong, g.target.dims.vocab_size)
    g._proposer = lambda name, ngram, adaptive=True: script
    try:
        out = g.generate(prompt, NEW, proposer="ngram", gamma=8, tree=16, stop_ids=[], adaptive=False)
    finally:
        del g._proposer
    assert out.tokens == reference
    assert script.rounds > 0 and out.stats.off_chain_accepted == script.rounds
    # What the cache holds equals a fresh prefill of the committed tokens (entries moved, nothing stale).
    committed = (prompt + out.tokens)[:-1]
    keys = [k.copy() for k in g.target.cache.keys]
    g.target.reset()
    g.target.prefill(committed)
    n = len(committed)
    for got, want in zip(keys, g.target.cache.keys):
        np.testing.assert_array_equal(got[:, :, :n], want[:, :, :n])


WINDOWED = {
    "mistral": {},
    # sliding and full layers, each with its RoPE base, soft-capped scores and logits, GeLU, norms after each block
    "gemma3": dict(tie=True, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   attn_logit_softcapping=0.05, final_logit_softcapping=3.0),
    "phi3": dict(partial_rotary_factor=0.75),  # fused projections, RoPE on 3/4 of each head
}


@pytest.fixture(scope="module", params=list(WINDOWED))
def window_gen(request, tmp_path_factory):
    """A tiny model whose attention slides over 4 positions, fewer than a tree's depth or a chain's length; a
    layer draft and tree graphs 8 and 16."""
    root = tmp_path_factory.mktemp("window")
    make_hf_model(str(root / "hf"), request.param, sliding_window=4, **WINDOWED[request.param])
    export_bundle(str(root / "hf"), str(root / "b"), ExportOptions(context=128, prefill_chunk=CHUNK, draft_layers=1,
                                                                   tree_sizes=(8, 16)), progress=False)
    g = Generator.load(str(root / "b"))
    yield g
    g.close()


def test_sliding_window_speculation_equals_plain_decode(window_gen):
    """Chains and trees on sliding-window attention (test_graph_parity checks plain decode against
    transformers): a tree node's window counts positions, its depth, not the slot its row sits in, so each
    verify row computes what decode computes at that position: the output is plain decode's, token for token,
    with drafts and tree nodes off the chain accepted and rejected, and a leaf forced at depth 5 accepted."""
    g = window_gen
    totals = np.zeros(4, int)
    for seed in range(4):
        prompt = (prompt_of if seed % 2 else few_symbols)(3 * CHUNK + 5, seed=seed)
        plain = g.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
        for proposer in ("ngram", "draft"):
            assert g.generate(prompt, NEW, proposer=proposer, gamma=8, stop_ids=[], adaptive=False).tokens == plain
            for tree, gamma in TREES:
                out = g.generate(prompt, NEW, proposer=proposer, gamma=gamma, tree=tree, stop_ids=[], adaptive=False)
                assert out.tokens == plain, (proposer, tree, seed)
                totals += [out.stats.tree_rounds, out.stats.off_chain_accepted, out.stats.accepted,
                           out.stats.proposed - out.stats.accepted]
    rounds, off_chain, accepted, rejected = totals
    assert rounds > 0 and off_chain > 0 and accepted > 0 and rejected > 0, totals
    prompt = prompt_of(21, seed=9)
    reference = g.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    script = TreeScript(len(prompt), reference, 5, g.target.dims.vocab_size)
    g._proposer = lambda name, ngram, adaptive=True: script
    try:
        out = g.generate(prompt, NEW, proposer="ngram", gamma=8, tree=16, stop_ids=[], adaptive=False)
    finally:
        del g._proposer
    assert out.tokens == reference and script.rounds > 0 and out.stats.off_chain_accepted == script.rounds


def test_tree_options_are_checked(tree_gens, tiny_bundle):
    g = tree_gens["layer"]
    with pytest.raises(GenerationError, match="tree 12 has no tree graph"):
        g.generate([5, 6, 7], 4, proposer="ngram", gamma=4, tree=12)
    with pytest.raises(GenerationError, match="gamma 8 drafts do not fit a tree of 7 nodes"):
        g.generate([5, 6, 7], 4, proposer="ngram", gamma=8, tree=8)
    plain = Generator.load(tiny_bundle)
    try:
        with pytest.raises(GenerationError, match="exported trees: none"):
            plain.generate([5, 6, 7], 4, proposer="ngram", gamma=4, tree=8)
    finally:
        plain.close()


def test_min_new_tokens_on_trees_equals_plain_decode(tree_gens):
    """The tree rows are held back by their depth (a leaf chooses the same new token as the chain node beside
    it), so tree speculation under min_new_tokens still equals plain decode under it."""
    rounds = 0
    for seed in range(4):
        prompt = few_symbols(3 * CHUNK + 5, seed=seed)
        for g in tree_gens.values():
            free = g.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
            held = free[2]
            min_new = free.index(held) + 3
            plain = g.generate(prompt, NEW, proposer="none", stop_ids=[held], min_new_tokens=min_new).tokens
            assert held not in plain[:min_new - 1] and plain[:free.index(held)] == free[:free.index(held)]
            for proposer in ("ngram", "draft"):
                out = g.generate(prompt, NEW, proposer=proposer, gamma=4, tree=16, stop_ids=[held],
                                 min_new_tokens=min_new, adaptive=False)
                assert out.tokens == plain, (seed, proposer)
                rounds += out.stats.tree_rounds
    assert rounds > 0


def test_min_new_tokens_holds_an_accepted_leafs_row_back_at_its_depth(tree_gens):
    """Every round accepts the leaf beside spine node 0 (depth 1, but step row 9): the bonus token after it
    is new token emitted + 1, so that row must be held back by its depth, not by its row index."""
    g = tree_gens["layer"]
    prompt = prompt_of(21, seed=9)
    free = g.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    held, min_new = free[1], 5  # plain decode chooses it as new token 1, the first round's bonus position
    reference = g.generate(prompt, NEW, proposer="none", stop_ids=[held], min_new_tokens=min_new).tokens
    assert reference[1] != held
    script = TreeScript(len(prompt), reference, 0, g.target.dims.vocab_size)
    g._proposer = lambda name, ngram, adaptive=True: script
    try:
        out = g.generate(prompt, NEW, proposer="ngram", gamma=8, tree=16, stop_ids=[held], min_new_tokens=min_new,
                         adaptive=False)
    finally:
        del g._proposer
    assert out.tokens == reference and out.stats.off_chain_accepted > 0


def test_a_held_back_stop_id_is_pruned_from_the_verified_trees(tree_gens, monkeypatch):
    """Prompt lookup's trees copy the held token from the context (an echo of the target's own continuation
    starts with it; six symbols give the other branches). Under min_new_tokens a node with it would be rejected, and everything under it, so
    the loop drops them before the verify step: no verified tree or chain holds it, and the output is
    plain decode's under the rule."""
    proposed = []

    def recording(make):
        def _proposer(self, *args):
            drafter = make(self, *args)
            propose_tree = getattr(drafter, "propose_tree", None)
            if propose_tree is not None:
                drafter.propose_tree = lambda *a: proposed.append(propose_tree(*a)) or proposed[-1]
            return drafter
        return _proposer

    monkeypatch.setattr(Generator, "_proposer", recording(Generator._proposer))
    pruned = rounds = 0
    for seed in range(3):
        base = few_symbols(2 * CHUNK + 5, seed=seed)
        for g in tree_gens.values():
            echo = g.generate(base, 16, proposer="none", stop_ids=[]).tokens
            prompt, held = base + echo + base[-6:], echo[0]  # lookup's spine is the echo, from `held` on
            plain = g.generate(prompt, NEW, proposer="none", stop_ids=[held], min_new_tokens=NEW).tokens
            verified, run, run_tree = [], g.target.run, g.target.run_tree
            monkeypatch.setattr(g.target, "run", lambda tokens, run=run: verified.append(list(tokens[1:])) or run(tokens))
            monkeypatch.setattr(g.target, "run_tree",
                                lambda layout, run_tree=run_tree: verified.append(layout.tokens[1:]) or run_tree(layout))
            proposed.clear()
            out = g.generate(prompt, NEW, proposer="ngram", gamma=4, tree=16, stop_ids=[held], min_new_tokens=NEW,
                             adaptive=False)
            assert out.tokens == plain, seed
            assert verified and all(held not in v for v in verified), seed
            pruned += sum(held in p.tokens for p in proposed)
            rounds += out.stats.tree_rounds
            monkeypatch.setattr(g.target, "run", run)
            monkeypatch.setattr(g.target, "run_tree", run_tree)
    assert pruned > 0 and rounds > 0  # proposed trees did hold it, and trees were verified


def test_pruning_a_tree_keeps_the_nodes_above_held_ones():
    # root -> 0 -> 1 -> 2 (the chain), leaves 3 (beside 0), 4 (beside 1) and 5 (beside 2)
    tree = Proposal([10, 11, 12, 13, 14, 15], None, [0, 1, 2, 0, 1, 2])
    cut = tree.emittable(0, 8, {11})  # node 1 (depth 2) is held: it goes with node 2 and leaf 5 under it
    assert (cut.tokens, cut.parents) == ([10, 13, 14], [0, 0, 1])
    assert tree.emittable(0, 1, {11}) is tree  # depth 2 is output position 1: no longer held there
    assert tree.emittable(5, 8, {12, 15}) is not tree and tree.emittable(6, 8, {12, 15}) is tree  # depth 3
    chain = tree.emittable(0, 8, {13, 14, 15})
    assert (chain.tokens, chain.parents) == ([10, 11, 12], None)  # only the spine left: a chain
    assert tree.emittable(0, 8, {10}).tokens == [13]  # the spine's first node: only the root's other leaf
    q = np.eye(6)
    assert Proposal([10, 11], q[:2]).emittable(1, 8, {11}).draft_probs.tolist() == q[:1].tolist()
    sampled = Proposal(tree.tokens, q, tree.parents).emittable(0, 8, {11})
    assert sampled.draft_probs.tolist() == q[[0, 3, 4]].tolist()  # each kept node keeps its own q


def test_tree_rows_are_penalized_with_their_ancestors(tree_gens):
    """A tree row follows its node's ancestors, not the nodes before it in index order: penalized that way,
    greedy tree speculation equals plain decode under the same penalties (runtime/penalties.py)."""
    penalties = dict(presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.02)
    totals = np.zeros(4, int)
    changed = 0
    for seed in range(4):
        prompt = few_symbols(3 * CHUNK + 5, seed=seed)
        for g in tree_gens.values():
            plain = g.generate(prompt, NEW, proposer="none", stop_ids=[], **penalties).tokens
            changed += plain != g.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
            for proposer in ("ngram", "draft"):
                out = g.generate(prompt, NEW, proposer=proposer, gamma=8, tree=16, stop_ids=[], adaptive=False,
                                 **penalties)
                assert out.tokens == plain, (proposer, seed)
                totals += [out.stats.tree_rounds, out.stats.off_chain_accepted, out.stats.accepted,
                           out.stats.proposed - out.stats.accepted]
    rounds, off_chain, accepted, rejected = totals
    assert changed >= 4 and rounds > 0 and off_chain > 0 and accepted > 0 and rejected > 0, totals
