"""specedge bench: its table and JSON on a tiny bundle, and clear errors for bad input."""
import json
import subprocess
import sys

import pytest


def bench(*args):
    return subprocess.run([sys.executable, "-m", "specedge", "bench", *args], capture_output=True, text=True)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": "copy", "kind": "grounded", "messages": [{"role": "user", "content": "t5 t6 t7 t5 t6 t7 t5 t6"}]},
             {"id": "free", "kind": "open", "messages": [{"role": "user", "content": "t9 t8"}]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def test_bench_table_json_and_plot(tiny_bundle, prompts, tmp_path):
    out, plot = tmp_path / "b.json", tmp_path / "b.png"
    r = bench(tiny_bundle, "--prompts", prompts, "--gamma", "2,4", "--repeats", "2", "--max-new-tokens", "12",
              "--json", str(out), "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    for config in ("none", "ngram g=2", "ngram g=4", "draft g=2", "draft g=4"):
        assert f"| grounded | {config} |" in r.stdout and f"| open | {config} |" in r.stdout
    assert "draft ms/round" in r.stdout and "peak RSS" in r.stdout
    result = json.load(open(out))
    assert len(result["runs"]) == 2 * 2 * 5  # repeats x prompts x configurations
    rows = {(row["config"], row["kind"]): row for row in result["rows"]}
    assert all(row["identical"] == row["prompts"] for row in result["rows"])  # greedy: same tokens everywhere
    assert rows[("none", "all")]["speedup"] == pytest.approx(1.0)
    assert plot.stat().st_size > 10_000


def test_sampled_bench_samples_every_configuration_with_its_seed(tiny_bundle, prompts, tmp_path, gen):
    """--temperature: each run is the sample its seed (seed + 1000 r + i) gives, speculation ran, and the
    outputs are not counted as identical or not."""
    out = tmp_path / "b.json"
    r = bench(tiny_bundle, "--prompts", prompts, "--proposers", "ngram,draft", "--gamma", "4", "--repeats", "2",
              "--max-new-tokens", "12", "--temperature", "0.8", "--top-k", "40", "--seed", "7", "--fixed-gamma",
              "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "| grounded | ngram g=4 |" in r.stdout and "| sampled |" in r.stdout and "temperature 0.8" in r.stdout
    result = json.load(open(out))
    assert result["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 1.0, "seed": 7}
    assert all(row["identical"] is None for row in result["rows"])
    ids = [gen.tokenizer.apply_chat_template(json.loads(line)["messages"]) for line in open(prompts)]
    by_seed = {}
    for run in result["runs"]:
        i = ["copy", "free"].index(run["prompt"])
        seeds = [7 + 1000 * rep + i for rep in range(2)]
        proposer = run["config"].split()[0]
        samples = [gen.generate(ids[i], 12, proposer=proposer, gamma=4, temperature=0.8, top_k=40, seed=s, adaptive=False,
                                min_new_tokens=12).tokens for s in seeds]
        assert run["tokens"] in samples, run["config"]
        by_seed.setdefault((run["config"], i), set()).add(tuple(run["tokens"]))
    assert all(len(outs) == 2 for outs in by_seed.values())  # each repeat draws its own sample
    rows = {(row["config"], row["kind"]): row for row in result["rows"]}
    assert 0 < rows[("draft g=4", "all")]["acceptance"] < 1  # (prompt lookup finds nothing in these samples)


@pytest.mark.parametrize("content, expected", [
    (None, "prompts file not found"),
    ("this is not json\n", "not JSON"),
    ("\n\n", "holds no prompts"),
    ('{"id": "x"}\n', "expected an object with \\\"messages\\\""),
])
def test_bad_prompt_files(tiny_bundle, tmp_path, content, expected):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    r = bench(tiny_bundle, "--prompts", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert expected.replace("\\", "") in r.stderr


@pytest.mark.parametrize("args, expected", [
    (["--gamma", "0,4"], "--gamma values must be at least 1, not 0"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--json", "/nonexistent/r.json"], "--json /nonexistent/r.json: cannot write into /nonexistent"),
    (["--plot", "/nonexistent/p.png"], "--plot /nonexistent/p.png: cannot write into /nonexistent"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature", "1", "--top-p", "0"], "top_p"),
    (["--temperature", "0.7", "--compare", "ort-genai"], "--compare runs the peers greedily"),
    (["--limit", "0"], "--limit must be at least 1, not 0"),  # ran every prompt
    (["--kinds", ","], "expected names separated by commas"),  # ran every kind
])
def test_bad_options(tiny_bundle, prompts, args, expected):
    r = bench(tiny_bundle, "--prompts", prompts, *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert expected in r.stderr, r.stderr


@pytest.mark.parametrize("module, peer, hints", [
    ("onnxruntime_genai", "ort-genai", ("onnxruntime-genai", "specedge[peers]")),
    ("llama_cpp", "llama.cpp", ("llama-cpp-python", "specedge[llamacpp]")),
])
def test_compare_with_a_missing_peer_names_the_extra(tiny_bundle, prompts, tiny_models, module, peer, hints):
    block = ("import sys\nclass B:\n    def find_spec(self, n, p=None, t=None):\n"
             f"        if n.split('.')[0] == {module!r}: raise ImportError('blocked')\n"
             "sys.meta_path.insert(0, B())\nfrom specedge.cli import main\n"
             f"sys.exit(main(['bench', {tiny_bundle!r}, '--prompts', {prompts!r}, '--compare', {peer!r}, "
             f"'--peer-model', {tiny_models['llama'][0]!r}]))")
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert all(h in r.stderr for h in hints), r.stderr


def test_unknown_peer_and_missing_draft(tiny_bundle, prompts, tiny_models, tmp_path):
    r = bench(tiny_bundle, "--prompts", prompts, "--compare", "vllm")
    assert r.returncode == 2 and "--compare takes transformers, ort-genai" in r.stderr
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "nodraft")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=64, prefill_chunk=16, gammas=(4,)),
                  progress=False)
    r = bench(out, "--prompts", prompts, "--proposers", "ngram,draft", "--gamma", "4")
    assert r.returncode == 2 and "needs a bundle with a draft model" in r.stderr
    # without --proposers: what the bundle can run (prompt lookup here)
    r = bench(out, "--prompts", prompts, "--gamma", "4", "--repeats", "1", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "| grounded | ngram g=4 |" in r.stdout and "| grounded | draft" not in r.stdout


class FakeLlama:
    """Stands in for llama_cpp.Llama in the kernel self-check: next-token scores per position, from a table."""

    def __init__(self, table):
        self.table, self.n = table, 0

    def tokenize(self, text, add_bos=False):
        return list(range(len(self.table)))

    def reset(self):
        self.n = 0

    def eval(self, ids):
        self.n = len(ids)

    @property
    def scores(self):
        return self.table[:self.n]


def test_llama_cpp_peer_refuses_a_build_whose_batches_disagree():
    """A llama.cpp build whose batched kernels compute another model (llama.cpp's AMX kernels did with Q4_1)
    is refused with the rebuild command; one whose batches agree with its one-token path is taken."""
    import numpy as np

    from specedge.tools.peers import PeerUnavailable, check_llama_cpp_kernels

    rng = np.random.default_rng(0)
    one_token = rng.standard_normal((64, 50))
    wrong = rng.standard_normal((64, 50))
    close = one_token + rng.standard_normal((64, 50)) * 1e-6
    check_llama_cpp_kernels(lambda **kw: FakeLlama(one_token if kw.get("n_batch") == 1 else close))
    with pytest.raises(PeerUnavailable, match="GGML_AMX_INT8=OFF"):
        check_llama_cpp_kernels(lambda **kw: FakeLlama(one_token if kw.get("n_batch") == 1 else wrong))
