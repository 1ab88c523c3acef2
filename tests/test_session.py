"""Sessions: a follow-up turn prefills only what the cache lacks and equals a fresh generation of the full
prompt; snapshots restore exactly; session files refuse other bundles and damage."""
import os
import zipfile

import numpy as np
import pytest
from conftest import CHUNK

from specedge.errors import SessionError
from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime.generator import Generator
from specedge.runtime.session import Session, SnapshotStore

NEW = 24


def prompt_of(length: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    head = rng.integers(2, 1000, (length + 1) // 2).tolist()
    return (head + head)[:length]


@pytest.fixture(scope="module")
def gens(tiny_bundle, tiny_pair_bundle):
    """A layer draft sharing the target's cache, and a separate draft model with a cache of its own."""
    out = {"layer": Generator.load(tiny_bundle), "pair": Generator.load(tiny_pair_bundle)}
    yield out
    for g in out.values():
        g.close()


def fresh(gen, prompt, **kw):
    return gen.generate(prompt, NEW, stop_ids=[], **kw)


CONFIGS = [("layer", "none"), ("layer", "ngram"), ("layer", "draft"), ("pair", "draft"), ("pair", "ngram")]


@pytest.mark.parametrize("which,proposer", CONFIGS)
def test_follow_up_turn_reuses_the_cache_and_equals_a_fresh_generation(gens, which, proposer):
    gen = gens[which]
    session = Session(gen)
    turn1 = prompt_of(3 * CHUNK + 3, seed=1)
    r1 = session.generate(turn1, max_new_tokens=NEW, proposer=proposer, stop_ids=[])
    assert r1.stats.reused_tokens == 0
    turn2 = turn1 + r1.tokens + prompt_of(7, seed=2)
    r2 = session.generate(turn2, max_new_tokens=NEW, proposer=proposer, stop_ids=[])
    # Everything but the last committed token (pending, never in the cache) came from turn 1.
    assert r2.stats.reused_tokens == len(turn1) + len(r1.tokens) - 1
    assert r2.tokens == fresh(gen, turn2, proposer=proposer).tokens
    if proposer != "none":
        assert r2.stats.proposed > 0 and r2.stats.accepted > 0


@pytest.mark.parametrize("which,proposer", [("layer", "ngram"), ("pair", "draft")])
def test_a_diverging_prompt_rolls_back_to_the_common_prefix(gens, which, proposer):
    gen = gens[which]
    session = Session(gen)
    base = prompt_of(2 * CHUNK + 5, seed=3)
    session.generate(base, max_new_tokens=NEW, proposer=proposer, stop_ids=[])
    edited = base[:20] + prompt_of(15, seed=4)  # an edited turn: shares 20 tokens, then differs
    assert edited[20] != base[20]
    r = session.generate(edited, max_new_tokens=NEW, proposer=proposer, stop_ids=[])
    assert r.stats.reused_tokens == 20
    assert r.tokens == fresh(gen, edited, proposer=proposer).tokens
    shorter = base[:10]  # a prompt inside the cached history: rolls back, prefills nothing
    r = session.generate(shorter, max_new_tokens=NEW, proposer=proposer, stop_ids=[])
    assert r.stats.reused_tokens == 9
    assert r.tokens == fresh(gen, shorter, proposer=proposer).tokens


class OracleProposer:
    """Proposes the plain greedy output itself: every draft is accepted, so a token limit cuts a round
    after drafts the target accepted and stored."""

    name = "ngram"

    def __init__(self, prompt_len: int, reference: list[int]):
        self.prompt_len, self.reference = prompt_len, reference

    def start(self, prompt, reuse=False):
        pass

    def propose(self, context, k, sampler):
        from specedge.runtime.proposers import Proposal

        done = len(context) - self.prompt_len
        return Proposal(list(self.reference[done:done + k]), None)

    def commit(self, n_accepted, next_token):
        pass


def test_a_cut_round_and_an_abandoned_stream_leave_a_reusable_cache(gens):
    gen = gens["layer"]
    session = Session(gen)
    prompt = prompt_of(30, seed=5)
    reference = fresh(gen, prompt, proposer="none").tokens
    gen._proposer = lambda name, ngram, adaptive=True: OracleProposer(len(prompt), reference)
    try:
        r1 = session.generate(prompt, max_new_tokens=5, proposer="ngram", gamma=8, stop_ids=[], adaptive=False)
    finally:
        del gen._proposer
    assert r1.tokens == reference[:5] and r1.stats.rounds == 1  # one round: 8 drafts accepted, cut at 5
    assert gen.target.history == (prompt + r1.tokens)[:-1]  # not the accepted drafts past the cut
    follow = prompt + r1.tokens + [7, 8, 9]
    stream = session.stream(follow, max_new_tokens=NEW, proposer="ngram", stop_ids=[])
    first = next(stream)
    stream.close()  # the consumer leaves after one round (a client that disconnected)
    assert gen.target.history == (follow + first)[:-1]
    r2 = session.generate(follow, max_new_tokens=NEW, proposer="ngram", stop_ids=[])
    assert r2.stats.reused_tokens == len(follow) - 1
    assert r2.tokens == fresh(gen, follow, proposer="ngram").tokens


def test_sampled_follow_up_equals_a_fresh_sampled_run_with_the_same_seed(gens):
    gen = gens["layer"]  # a one-layer draft of a three-layer target: sampled drafts are often rejected
    session = Session(gen)
    turn1 = prompt_of(30, seed=6)
    r1 = session.generate(turn1, max_new_tokens=NEW, proposer="draft", temperature=0.3, seed=3, stop_ids=[])
    turn2 = turn1 + r1.tokens + [11, 12]
    r2 = session.generate(turn2, max_new_tokens=NEW, proposer="draft", temperature=0.3, seed=4, stop_ids=[])
    assert r2.stats.reused_tokens > 0 and r2.stats.accepted > 0
    assert r1.stats.proposed + r2.stats.proposed > r1.stats.accepted + r2.stats.accepted  # rejections ran too
    assert r2.tokens == fresh(gen, turn2, proposer="draft", temperature=0.3, seed=4).tokens


def test_sessions_sharing_a_generator_each_resume_their_own_cache(gens):
    gen = gens["pair"]
    a, b = Session(gen), Session(gen)
    pa, pb = prompt_of(50, seed=7), prompt_of(45, seed=8)
    ra = a.generate(pa, max_new_tokens=NEW, proposer="draft", stop_ids=[])
    rb = b.generate(pb, max_new_tokens=NEW, proposer="draft", stop_ids=[])
    assert rb.stats.reused_tokens == 0
    pa2 = pa + ra.tokens + [5, 6]
    ra2 = a.generate(pa2, max_new_tokens=NEW, proposer="draft", stop_ids=[])  # restores a's snapshot
    assert ra2.stats.reused_tokens == len(pa) + len(ra.tokens) - 1
    assert ra2.tokens == fresh(gen, pa2, proposer="draft").tokens
    pb2 = pb + rb.tokens + [9]
    rb2 = b.generate(pb2, max_new_tokens=NEW, proposer="draft", stop_ids=[])
    assert rb2.stats.reused_tokens == len(pb) + len(rb.tokens) - 1
    assert rb2.tokens == fresh(gen, pb2, proposer="draft").tokens


def test_reuse_across_context_buckets(tiny_models, tmp_path):
    """Turn 1 fits the smallest bucket, turn 2 grows past it; a restored snapshot lands in the smallest
    bucket that holds it."""
    bundle = str(tmp_path / "buckets")
    export_bundle(tiny_models["llama"][0], bundle, ExportOptions(context=128, prefill_chunk=CHUNK,
                                                                 context_buckets=(32, 64), draft_layers=1),
                  progress=False)
    gen = Generator.load(bundle)
    try:
        a, b = Session(gen), Session(gen)
        turn1 = prompt_of(20, seed=9)
        r1 = a.generate(turn1, max_new_tokens=8, proposer="draft", stop_ids=[])
        assert gen.target.cache.bucket == 32
        b.generate(prompt_of(70, seed=10), max_new_tokens=8, proposer="draft", stop_ids=[])
        assert gen.target.cache.bucket == 128
        turn2 = turn1 + r1.tokens + prompt_of(40, seed=11)
        r2 = a.generate(turn2, max_new_tokens=NEW, proposer="draft", stop_ids=[])
        assert r2.stats.reused_tokens == len(turn1) + len(r1.tokens) - 1
        assert gen.target.cache.bucket == 128  # 32 -> 128: restored into 32, then grown by the new turn
        assert r2.tokens == fresh(gen, turn2, proposer="draft").tokens
    finally:
        gen.close()


def test_save_and_load_round_trip_in_a_new_generator(tiny_pair_bundle, gens, tmp_path):
    gen = gens["pair"]
    session = Session(gen)
    turn1 = prompt_of(37, seed=12)
    r1 = session.generate(turn1, max_new_tokens=NEW, proposer="draft", stop_ids=[])
    path = str(tmp_path / "chat.session")
    session.save(path)
    turn2 = turn1 + r1.tokens + [3, 4, 5]
    want = fresh(gen, turn2, proposer="draft").tokens
    other = Generator.load(tiny_pair_bundle)  # another process would do the same
    try:
        restored = Session.load(other, path)
        assert restored.tokens == (turn1 + r1.tokens)[:-1]
        r2 = restored.generate(turn2, max_new_tokens=NEW, proposer="draft", stop_ids=[])
        assert r2.stats.reused_tokens == len(turn1) + len(r1.tokens) - 1
        assert r2.tokens == want
    finally:
        other.close()
    assert [f for f in os.listdir(tmp_path) if ".tmp" in f] == []


def test_session_files_from_another_bundle_or_damaged_are_refused(gens, tmp_path):
    layer, pair = gens["layer"], gens["pair"]
    session = Session(layer)
    session.generate(prompt_of(20, seed=13), max_new_tokens=4, proposer="none", stop_ids=[])
    path = str(tmp_path / "a.session")
    session.save(path)
    with pytest.raises(SessionError, match="different bundle"):
        Session.load(pair, path)
    with open(path, "rb") as f:
        data = f.read()
    damaged = str(tmp_path / "damaged.session")
    with open(damaged, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(SessionError, match="not a readable session file"):
        Session.load(layer, damaged)
    with pytest.raises(SessionError, match="not found"):
        Session.load(layer, str(tmp_path / "missing.session"))
    forged = str(tmp_path / "forged.session")  # right digest, wrong shapes
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(forged, "w") as out:
        for name in z.namelist():
            out.writestr(name, z.read(name) if name != "target/0.npy" else _npy(np.zeros((1, 2, 3), np.float32)))
    with pytest.raises(SessionError, match="do not fit"):
        Session.load(layer, forged)


def _npy(a):
    import io

    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_snapshot_store_resumes_the_conversation_with_the_longest_prefix(gens):
    gen = gens["layer"]
    gen.target.reset()
    store = SnapshotStore(gen, min_tokens=4)
    convs = [prompt_of(30 + 5 * i, seed=20 + i) for i in range(3)]
    results = []
    for conv in convs:
        assert store.prepare(conv) == 0
        results.append(gen.generate(conv, NEW, proposer="ngram", stop_ids=[], reuse=True))
    assert len(store) == 2  # the first two were stashed when the next one replaced them; the third is live
    for conv, r in zip(convs, results):
        follow = conv + r.tokens + [42]
        keep = store.prepare(follow)
        assert keep == len(conv) + len(r.tokens) - 1
        out = gen.generate(follow, NEW, proposer="ngram", stop_ids=[], reuse=True)
        assert out.stats.reused_tokens == keep
        assert out.tokens == fresh(gen, follow, proposer="ngram").tokens
    d = gen.target.dims
    per_token = 2 * d.num_layers * d.num_kv_heads * d.head_dim * 4
    gen.target.reset()
    small = SnapshotStore(gen, max_bytes=per_token * (len(convs[-1]) + 4), min_tokens=4)  # one conversation
    for conv in convs:
        small.prepare(conv)
        gen.generate(conv, 4, proposer="none", stop_ids=[], reuse=True)
    assert len(small) == 1 and small.nbytes <= small.max_bytes  # the oldest went first
    assert small.prepare(convs[1] + [1]) == len(convs[1])  # the newest stored one is still there


def test_cli_session_file_carries_the_cache_between_runs(tiny_bundle, gens, tmp_path, capsys):
    import json

    from specedge.cli import main

    path = str(tmp_path / "cli.session")
    turn1 = prompt_of(30, seed=30)

    def run(prompt):
        assert main(["generate", tiny_bundle, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
                     str(NEW), "--proposer", "ngram", "--session", path, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    first = run(turn1)
    assert first["stats"]["reused_tokens"] == 0 and os.path.isfile(path)
    turn2 = turn1 + first["tokens"] + [5, 6, 7]
    second = run(turn2)
    assert second["stats"]["reused_tokens"] == len(turn1) + len(first["tokens"]) - 1
    assert second["tokens"] == fresh(gens["layer"], turn2, proposer="ngram").tokens
    with open(path, "r+b") as f:
        f.truncate(100)
    assert main(["generate", tiny_bundle, "--prompt-ids", "5,6", "--session", path]) == 2
    assert "not a readable session file" in capsys.readouterr().err
