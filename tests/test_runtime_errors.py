"""Bad input to the runtime ends in one clear message and a non-zero exit, never a traceback; and the
runtime runs where torch cannot even be imported."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import CHUNK

from specedge.errors import BundleError, GenerationError
from specedge.runtime.generator import Generator


def generate(bundle, *args):
    return subprocess.run([sys.executable, "-m", "specedge", "generate", bundle, *args], capture_output=True,
                          text=True)


def assert_clean_error(r, expected):
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, expected", [
    (["--prompt-ids", ",".join(["5"] * 128)], "must be shorter than that"),
    (["--prompt-ids", "5,6", "--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    (["--prompt-ids", "5,6", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "5,6", "--temperature", "1", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "5,6", "--temperature", "1", "--top-p", "1.5"], "top_p"),
    (["--prompt-ids", "5,6", "--top-k", "-3"], "top_k"),
    (["--prompt-ids", "5,6", "--proposer", "ngram", "--gamma", "3"], "gamma 3 has no verify graph"),
    (["--prompt-ids", "5,6,99999"], "outside the vocabulary"),
    (["--prompt-ids", "5,6", "--min-new-tokens", "-2"], "min_new_tokens must be an int >= 0"),
    (["--prompt-ids", "5,6", "--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
    (["--prompt-ids", "5,6", "--presence-penalty", "-3"], "presence_penalty must be a number in [-2, 2]"),
    (["--prompt-ids", "5,6", "--temperature", "1", "--min-p", "-0.5"], "min_p must be a finite number in [0, 1]"),
    (["--prompt-ids", "5,6", "--logit-bias", "5=300"], "logit_bias values must be numbers in [-100, 100]"),
    (["--prompt-ids", "5,6", "--logit-bias", "99999=1"], "logit_bias token 99999 is outside the vocabulary"),
    (["--prompt-ids", "5,6", "--logit-bias", "5:1"], ""),  # argparse: not ID=BIAS (exit 2)
    (["--prompt-ids", "5,6", "--logprobs", "2"], "--logprobs needs --json"),
    (["--prompt-ids", "5,6", "--json", "--logprobs", "21"], "logprobs must be an int in 0..20"),
    (["--prompt-ids", "5,6", "--threads", "0"], "threads must be at least 1, not 0"),
    (["--prompt-ids", "5,6", "--threads", "100000"], "threads 100000 is more than 8x this machine's"),
    (["--prompt-ids", "5,6", "--proposer", "ngram", "--gamma", "0"], "gamma (drafts per round) must be at least 1"),
    (["--prompt-ids", "5,6", "--session", "/nonexistent/dir/s.bin"], "/nonexistent/dir is not a writable folder"),
    (["--prompt-ids", "5,6", "--temperature", "1", "--seed", "-1"], "seed must be an int >= 0 (or left out), not -1"),
    (["--prompt", "t5 t6", "--chat", "--prompt-ids", "1"], ""),  # argparse: mutually exclusive (exit 2)
])
def test_bad_generation_input(tiny_bundle, args, expected):
    r = generate(tiny_bundle, *args)
    if expected:
        assert_clean_error(r, expected)
    else:
        assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, kwargs, expected", [
    (("t5 t6", 4), {}, "the prompt must be token ids, not text"),
    (([5, 6.5], 4), {}, "the prompt must be integer token ids; it holds 6.5"),
    (([5, 6], 4.0), {}, "max_new_tokens must be an int, not 4.0"),
    (([5, 6], 4), {"proposer": "ngram", "gamma": "4"}, "gamma must be an int, not '4'"),
    (([5, 6], 4), {"proposer": "ngram", "tree": "9"}, "tree must be an int >= 0 (0 = chains), not '9'"),
    (([5, 6], 4), {"proposer": "ngram", "tree": -1}, "tree must be an int >= 0 (0 = chains), not -1"),
    (([5, 6], 4), {"proposer": "ngram", "ngram": (0, 2)}, "ngram must be (n_min, n_max) with 1 <= n_min <= n_max"),
    (([5, 6], 4), {"proposer": "ngram", "ngram": "x"}, "ngram must be (n_min, n_max)"),
    (([5, 6], 4), {"proposer": "ngram", "ngram": 3}, "ngram must be a list, not 3"),
    ((None, 4), {}, "the prompt must be a list of token ids, not None"),
    (([5, 6], 4), {"stop_ids": "x"}, "stop_ids must be a list of token ids"),
    (([5, 6], 4), {"stop_ids": [2.5]}, "stop_ids must be a list of token ids"),
])
def test_bad_api_input_is_a_generation_error(tiny_bundle, args, kwargs, expected):
    """The embedded runtime's bad arguments are GenerationErrors (ValueErrors) saying what is wrong, not a
    TypeError from deep inside the loop or a silent int() of a float or of text."""
    gen = Generator.load(tiny_bundle)
    try:
        with pytest.raises(GenerationError) as raised:
            gen.generate(*args, **kwargs)
        assert expected in str(raised.value)
    finally:
        gen.close()


def test_draft_proposer_needs_a_draft(tiny_models, tmp_path):
    from specedge.export.bundle import ExportOptions, export_bundle

    out = str(tmp_path / "nodraft")
    export_bundle(tiny_models["llama"][0], out, ExportOptions(context=64, prefill_chunk=CHUNK, gammas=(4,)),
                  progress=False)
    assert_clean_error(generate(out, "--prompt-ids", "5,6", "--proposer", "draft"), "needs a bundle with a draft")
    gen = Generator.load(out)  # the API's default, as the CLI's: prompt lookup where there is no draft model
    try:
        assert gen.generate([5, 6, 5, 6, 5], 6).stats.proposer == "ngram"
    finally:
        gen.close()


def damaged(tiny_pair_bundle, tmp_path, how):
    b = str(tmp_path / how)
    shutil.copytree(tiny_pair_bundle, b)
    path = f"{b}/manifest.json"
    m = json.load(open(path))
    if how == "vocab":  # the exporter's record of how the vocabularies were matched says they differ
        m["vocab"] = {"target": 1000, "draft": 1000, "match": None}
    elif how == "dims":
        m["models"]["target"]["num_kv_heads"] = 4
    elif how == "truncated":
        graph = f"{b}/target.step5.s128.onnx"
        data = open(graph, "rb").read()
        open(graph, "wb").write(data[: len(data) // 3])
    elif how == "weights":
        os.remove(f"{b}/target.weights.bin")
    elif how == "not_json":
        open(path, "w").write("{not json")
        return b
    elif how == "version":
        m["version"] = 99
    elif how == "row_graph":  # a row graph (batch 1) in a model of batch 1
        m["models"]["target"]["graphs"][0]["batch"] = 1
    elif how == "manifest_array":  # valid JSON, but not an object
        m = [1, 2]
    elif how == "manifest_dir":
        os.remove(path)
        os.mkdir(path)
        return b
    elif how == "num_layers_text":
        m["models"]["target"]["num_layers"] = "30"
    elif how == "version_text":
        m["version"] = str(m["version"])
    elif how.startswith("index_"):
        index_path = f"{b}/target.weights.json"
        index = json.load(open(index_path))
        if how == "index_array":
            index = []
        elif how == "index_no_length":
            del index["embed"]["length"]
        elif how == "index_negative_offset":
            index["embed"]["offset"] = -5
        json.dump(index, open(index_path, "w"))
        return b
    elif how == "tokenizer_garbage":
        open(f"{b}/tokenizer/tokenizer.json", "w").write("garbage, not JSON")
        return b
    elif how == "tokenizer_empty":
        open(f"{b}/tokenizer/tokenizer.json", "w").write("{}")
        return b
    json.dump(m, open(path, "w"))
    return b


@pytest.mark.parametrize("how, expected", [
    ("vocab", "vocabularies do not match"),
    ("dims", "manifest disagrees with target"),
    ("truncated", "target.step5.s128.onnx is corrupt"),
    ("weights", "weights file missing"),
    ("not_json", "not valid JSON"),
    ("version", "version 99 is not supported"),
    ("row_graph", "only graphs of batch 1 without a step mask, in a model of batch > 1, may set it"),
])
def test_corrupt_bundles(tiny_pair_bundle, tmp_path, how, expected):
    b = damaged(tiny_pair_bundle, tmp_path, how)
    assert_clean_error(generate(b, "--prompt-ids", "5,6,7", "--proposer", "draft", "--gamma", "4"), expected)


TOKENIZER_UNREADABLE = "tokenizer/tokenizer.json is not a tokenizer the tokenizers package can read: "


@pytest.mark.parametrize("how, expected", [
    ("manifest_array", "manifest.json is corrupt: it holds a JSON array, not an object"),
    ("manifest_dir", "manifest.json cannot be read (Is a directory)"),
    ("num_layers_text", "manifest.json is corrupt: models.target: num_layers must be an integer, not '30'"),
    ("version_text", "manifest.json is corrupt: version must be an integer, not '4'"),
    ("index_array", "target.weights.json is corrupt: it holds a JSON array, not an object"),
    ("index_no_length", "target.weights.json is corrupt: entry 'embed' has no 'length'"),
    ("index_negative_offset", "target.weights.json is corrupt: entry 'embed': offset must be at least 0, not -5"),
    ("tokenizer_garbage", TOKENIZER_UNREADABLE + "expected value at line 1 column 1"),
    ("tokenizer_empty", TOKENIZER_UNREADABLE),
])
def test_corrupt_bundle_files(tiny_pair_bundle, tmp_path, how, expected):
    """A bundle file that is valid JSON of the wrong shape, or not what its reader takes, is one clear message
    everywhere: generate exits 2 with it (as serve and bench, which load the same way; they used to end in an
    AttributeError, TypeError, IsADirectoryError or ValueError traceback, or the tokenizers package's bare
    Exception), Generator.load raises it as a BundleError, and check reports it as a FAIL line (it used to pass an
    unreadable tokenizer)."""
    b = damaged(tiny_pair_bundle, tmp_path, how)
    assert_clean_error(generate(b, "--prompt-ids", "5,6,7", "--max-new-tokens", "2"), expected)
    with pytest.raises(BundleError) as raised:
        Generator.load(b).close()
    assert expected in str(raised.value)
    r = subprocess.run([sys.executable, "-m", "specedge", "check", b, "--no-load"], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert any(line.startswith("  FAIL") and expected in line for line in r.stdout.splitlines()), r.stdout
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize("args, expected", [(["--gamma", "0"], "--gamma 0: the demo bundle verifies gammas 1, 2, 4, 8"),
                                            (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1")])
def test_bad_demo_input_is_refused_before_the_export(tmp_path, args, expected):
    r = subprocess.run([sys.executable, "-m", "specedge", "demo", *args], capture_output=True, text=True,
                       env={**os.environ, "SPECEDGE_CACHE": str(tmp_path / "cache")})
    assert_clean_error(r, expected)
    assert not (tmp_path / "cache").exists()  # nothing exported


def test_missing_bundle(tmp_path):
    assert_clean_error(generate(str(tmp_path / "nope"), "--prompt-ids", "1"), "bundle not found")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # a model file where a bundle belongs
    assert_clean_error(generate(str(tmp_path / "model.gguf"), "--prompt-ids", "1"), "is a file, not a bundle directory")


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'onnx'):
            raise ImportError(f'{name} is blocked in this test')
sys.meta_path.insert(0, Block())
"""


def test_runtime_runs_without_torch(tiny_bundle, tmp_path):
    """The runtime imports and generates with only numpy + onnxruntime (+ tokenizers for text)."""
    script = BLOCK_TORCH + f"""
from specedge.runtime.generator import Generator
g = Generator.load({tiny_bundle!r})
out = g.generate([5, 6, 7, 5, 6], 12, proposer="draft", gamma=4, stop_ids=[])
out2 = g.generate([5, 6, 7, 5, 6], 12, proposer="ngram", gamma=4, temperature=0.8, top_k=50, seed=1, stop_ids=[])
assert len(out.tokens) == 12 and len(out2.tokens) == 12
assert not any(m.split('.')[0] in ('torch', 'transformers', 'onnx') for m in sys.modules)
print("ok", out.text)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr
    cli = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import sys; from specedge.cli import main; "
                          f"sys.exit(main(['generate', {tiny_bundle!r}, '--prompt', 't5 t6 t7', '--json', "
                          "'--max-new-tokens', '5']))"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert out["prompt_ids"] == [5, 6, 7] and len(out["tokens"]) == 5 and out["stats"]["new_tokens"] == 5


def test_gpu_backend_without_its_provider_says_what_to_install(tiny_bundle):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    assert_clean_error(generate(tiny_bundle, "--prompt-ids", "5,6", "--backend", "cuda"), "CUDAExecutionProvider")


def test_a_gpu_provider_that_cannot_start_is_an_error_not_a_cpu_run(tiny_bundle, monkeypatch, request):
    """onnxruntime creates the session on the next provider, with a warning only, when the first cannot
    start. Here the CPU build is told that CUDA is available: its session runs on the CPU, and the backend
    must say so instead of running a `cuda` generation on the CPU."""
    import onnxruntime as ort

    from specedge.errors import BackendError
    from specedge.runtime.generator import Generator

    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available:
        pytest.skip("this onnxruntime has the CUDA provider")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider"] + available)
    with pytest.raises(BackendError, match="could not start CUDAExecutionProvider .* fell back to "
                                           "CPUExecutionProvider"):
        gen = Generator.load(tiny_bundle, backend="cuda")
        request.addfinalizer(gen.close)  # its mapping of the weights file would count in test_weight_pages
        gen.generate([5, 6], max_new_tokens=2, proposer="none")


def test_missing_onnxruntime_says_what_to_install(tiny_bundle):
    # A None entry in sys.modules is what Python shows for a package that is not installed: importing it
    # raises ModuleNotFoundError and importlib.util.find_spec returns None.
    script = f"""
import sys
sys.modules['onnxruntime'] = None
from specedge.cli import main
sys.exit(main(['generate', {tiny_bundle!r}, '--prompt-ids', '5,6']))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert_clean_error(r, "pip install onnxruntime")


def test_device_provider_sessions_send_the_inputs_again_at_every_run():
    """onnxruntime copies a host-bound input to the device when it is bound, not at each run (IOBinding::
    BindInput), so a CUDA or TensorRT session bound once would read its first step's tokens and cache forever
    (seen on an H200: every draft rejected, output unlike the CPU's from the first token). Their sessions bind
    the inputs again before each run; CPU sessions, which read the host buffers in place, bind once."""
    from specedge.runtime.backends.ort_python import OrtSession

    class Binding:
        def __init__(self):
            self.inputs = []

        def bind_input(self, name, device, device_id, dtype, shape, pointer):
            self.inputs.append(name)

        def bind_output(self, *args):
            pass

    class Session:
        def __init__(self):
            self.binding, self.runs = Binding(), 0

        def get_inputs(self):
            return [type("Arg", (), {"name": "input_ids", "type": "tensor(int64)", "shape": [1, 1]})()]

        get_outputs = get_inputs

        def io_binding(self):
            return self.binding

        def run_with_iobinding(self, binding):
            self.runs += 1
            if self.runs == 3:  # what onnxruntime raises when a kernel of the provider fails
                raise RuntimeError("Non-zero status code returned while running DequantizeLinear node.\nmore")

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    for rebind, binds in ((True, 3), (False, 1)):
        fake = Session()
        session = OrtSession(fake, rebind_inputs=rebind, name="target.step1.s128.onnx")
        session.bind({"input_ids": np.zeros((1, 1), np.int64)}, {"input_ids": np.zeros((1, 1), np.int64)})
        session.run()
        session.run()
        assert fake.runs == 2 and fake.binding.inputs == ["input_ids"] * binds
    # A failing run is one clear error, not onnxruntime's exception type.
    from specedge.errors import PlacementError

    with pytest.raises(PlacementError, match=r"^onnxruntime failed running target.step1.s128.onnx on "
                       r"CUDAExecutionProvider: Non-zero status code returned while running DequantizeLinear node.$"):
        session.run()
