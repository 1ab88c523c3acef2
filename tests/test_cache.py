"""`specedge cache`: listing, pruning (crash leftovers, by age, least recently used down to a size) and clearing
the cache directory, and the caches marking their entries used so that pruning keeps what runs use."""
from __future__ import annotations

import os
import time

import pytest

from specedge.cli import main
from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime.generator import Generator
from specedge.tools import cache as cache_tool

NOW = time.time()  # the entries' ages are set from it; the command reads the clock a few ms later
HOUR, DAY = 3600.0, 86400.0


def _entry(root, rel: str, size: int, age_s: float, source: str | None = None) -> str:
    """A cache entry folder holding `size` bytes, last used `age_s` before NOW."""
    path = os.path.join(root, rel)
    os.makedirs(path)
    with open(os.path.join(path, "blob"), "wb") as f:
        f.write(b"x" * size)
    if source:
        cache_tool.record_source(path, source)
    os.utime(path, (NOW - age_s, NOW - age_s))
    return path


@pytest.fixture
def cache(tmp_path):
    """Three entries (bundles/a oldest, ort/b, qnn/c newest), two unfinished writes (one a crash's leftover, one
    in progress), a leftover inside an ort entry, and files specedge did not make."""
    root = tmp_path / "cache"
    _entry(root, "bundles/a", 100, 5 * DAY)
    b = _entry(root, "ort/b", 200, 3 * DAY)
    _entry(root, "qnn/c", 300, HOUR / 2)
    _entry(root, "qnn/.k1.tmp-crashed", 40, 2 * HOUR)
    _entry(root, "qnn/.k2.tmp-writing", 50, 60)
    for name, age in ((".tmp-old", 2 * HOUR), (".tmp-new", 60)):
        with open(os.path.join(b, name), "wb") as f:
            f.write(b"y" * 7)
        os.utime(os.path.join(b, name), (NOW - age, NOW - age))
    os.utime(b, (NOW - 3 * DAY, NOW - 3 * DAY))
    (root / "notes.txt").write_text("mine")
    (root / "qnn" / "README").write_text("mine too")
    os.makedirs(root / "other")
    return root


def _names(root) -> set[str]:
    return {e.name for e in cache_tool.entries(str(root))}


def test_entries_are_listed_least_recently_used_first_with_their_sizes(cache):
    found = cache_tool.entries(str(cache))
    assert [e.name for e in found] == ["bundles/a", "ort/b", "qnn/.k1.tmp-crashed", "qnn/c", "qnn/.k2.tmp-writing"]
    assert [e.size for e in found] == [100, 214, 40, 300, 50]
    assert [e.unfinished for e in found] == [False, False, True, False, True]


def test_prune_removes_crash_leftovers_and_keeps_writes_in_progress(cache):
    removed = cache_tool.prune(str(cache), now=NOW)
    assert [e.name for e in removed] == ["qnn/.k1.tmp-crashed"]
    assert _names(cache) == {"bundles/a", "ort/b", "qnn/c", "qnn/.k2.tmp-writing"}
    assert sorted(os.listdir(cache / "ort" / "b")) == [".tmp-new", "blob"]  # the hour-old tensor write is gone
    assert (cache / "notes.txt").exists() and (cache / "qnn" / "README").exists() and (cache / "other").exists()


def test_prune_by_age(cache):
    removed = cache_tool.prune(str(cache), unused_for_s=4 * DAY, now=NOW)
    assert {e.name for e in removed} == {"bundles/a", "qnn/.k1.tmp-crashed"}
    cache_tool.prune(str(cache), unused_for_s=HOUR, now=NOW)
    assert _names(cache) == {"qnn/c", "qnn/.k2.tmp-writing"}  # a write in progress is never pruned by age


@pytest.mark.parametrize("max_bytes,left", [(10_000, {"bundles/a", "ort/b", "qnn/c"}),
                                            (600, {"ort/b", "qnn/c"}),  # 100 + 214 + 300 + 50 > 600
                                            (400, {"qnn/c"}), (0, set())])
def test_prune_to_a_size_removes_least_recently_used_first(cache, max_bytes, left):
    cache_tool.prune(str(cache), max_bytes=max_bytes, now=NOW)
    assert _names(cache) == left | {"qnn/.k2.tmp-writing"}


def test_clear_removes_every_entry_and_nothing_else(cache):
    gone = cache_tool.clear(str(cache))
    assert len(gone) == 5 and _names(cache) == set()
    assert sorted(os.listdir(cache)) == ["bundles", "notes.txt", "ort", "other", "qnn"]
    assert os.listdir(cache / "qnn") == ["README"]


@pytest.mark.parametrize("text,size", [("0", 0), ("512", 512), ("500M", 500 << 20), ("2g", 2 << 30),
                                       ("1.5GB", 3 << 29), ("64 kb", 64 << 10)])
def test_sizes(text, size):
    assert cache_tool.parse_size(text) == size


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own refusals
        return e.code


@pytest.mark.parametrize("argv,message", [
    (["cache", "prune"], "prune needs --max-size SIZE or --unused-for DAYS"),
    (["cache", "list", "--max-size", "1G"], "go with `specedge cache prune`"),
    (["cache", "clear", "--unused-for", "3"], "go with `specedge cache prune`"),
    (["cache", "prune", "--max-size", "2X"], "expected a size such as 500M or 2G, got '2X'"),
    (["cache", "prune", "--max-size=-1G"], "expected a size such as 500M or 2G, got '-1G'"),
    (["cache", "prune", "--unused-for=-2"], "expected a number of days >= 0, got '-2'"),
    (["cache", "prune", "--unused-for", "nan"], "expected a number of days >= 0"),
    (["cache", "shrink"], "invalid choice: 'shrink'"),
])
def test_bad_cache_commands_are_one_line_and_exit_2(cache, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("SPECEDGE_CACHE", str(cache))
    assert _status(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(_names(cache)) == 5  # nothing removed


@pytest.mark.parametrize("action", ["list", "clear"])
def test_a_cache_that_is_a_file_is_one_clear_error(tmp_path, monkeypatch, capsys, action):
    """SPECEDGE_CACHE naming a file was listed as an empty cache."""
    path = tmp_path / "cache.txt"
    path.write_text("not a cache")
    monkeypatch.setenv("SPECEDGE_CACHE", str(path))
    assert _status(["cache", action]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err and path.read_text() == "not a cache"


def test_cache_command_lists_prunes_and_clears(cache, monkeypatch, capsys):
    monkeypatch.setenv("SPECEDGE_CACHE", str(cache))
    cache_tool.record_source(str(cache / "qnn" / "c"), "/bundles/x/target.step_t9.onnx")
    os.utime(cache / "qnn" / "c", (NOW - HOUR / 2,) * 2)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    total = 704 + os.path.getsize(cache / "qnn" / "c" / cache_tool.SOURCE_FILE)
    assert out[0] == f"cache: {cache} ({total} B in 5 entries)"
    assert [line.split()[0] for line in out[1:]] == ["bundles/a", "ort/b", "qnn/.k1.tmp-crashed", "qnn/c",
                                                     "qnn/.k2.tmp-writing"]
    assert "used 5.0 days ago" in out[1] and "used 0.5 hours ago" in out[4]
    assert out[4].endswith("from /bundles/x/target.step_t9.onnx") and out[5].endswith("unfinished write")
    assert main(["cache", "prune", "--max-size", "0.4K"]) == 0  # 409 bytes: qnn/c (342) and the write (50) stay
    assert capsys.readouterr().out.startswith("removed 3 entries (354 B)")
    assert _names(cache) == {"qnn/c", "qnn/.k2.tmp-writing"}
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.startswith("removed 2 entries (") and _names(cache) == set()


def test_optimized_graph_cache_records_its_source_and_use(tiny_models, tmp_path, monkeypatch):
    """An int4 bundle's optimized-graph entry says which weights file it was made from, a later load marks it
    used (so `prune --unused-for` keeps it), and after a prune removed it a load makes it again, same tokens."""
    monkeypatch.setenv("SPECEDGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECEDGE_ORT_CACHE", raising=False)
    bundle = str(tmp_path / "int4")
    opts = ExportOptions(context=64, gammas=(4,), prefill_chunk=16, quant="int4")
    export_bundle(tiny_models["llama"][0], bundle, opts, progress=False)
    prompt = [5, 9, 11, 4, 7]

    def tokens():
        gen = Generator.load(bundle)
        out = gen.generate(prompt, 8, proposer="none", stop_ids=[]).tokens
        gen.close()
        return out

    first = tokens()
    (entry,) = cache_tool.entries(str(tmp_path / "cache"))
    assert entry.part == "ort" and entry.source == os.path.join(bundle, "target.weights.bin")
    os.utime(entry.path, (time.time() - 10 * DAY,) * 2)
    assert tokens() == first
    assert not cache_tool.prune(str(tmp_path / "cache"), unused_for_s=DAY)  # the load marked it used
    os.utime(entry.path, (time.time() - 10 * DAY,) * 2)
    (removed,) = cache_tool.prune(str(tmp_path / "cache"), unused_for_s=DAY)
    assert removed.path == entry.path and not os.path.exists(entry.path)
    assert tokens() == first
    assert [e.path for e in cache_tool.entries(str(tmp_path / "cache"))] == [entry.path]
