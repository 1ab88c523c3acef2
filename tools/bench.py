"""`specedge bench`: every configuration on every prompt, in one process, interleaved, with medians.

Configurations are plain decode (`none`), each proposer at each gamma, and optionally peer systems
(`--compare transformers,ort-genai,ort-genai-int4,llama.cpp`) on the same prompt ids, threads and token budget. Runs interleave
(repeat -> prompt -> configuration) so drift on a shared machine hits every configuration alike; each
(prompt, configuration) keeps the median of its repeats. Greedy outputs are compared with plain decode's
token for token.

With `--temperature T` (and top-k/top-p) every configuration samples; repeat r of prompt i gets the seed
seed + 1000 r + i in every configuration. Speculative sampling follows the target's law but draws other
tokens than plain decode with the same seed, so the outputs are not compared, and a configuration's speed is
measured on its own samples: use several prompts and repeats. Peers run greedy only.

Every run, ours and the peers', produces exactly `max_new_tokens` tokens with EOS held back until then
(`min_new_tokens`), so all of them decode the same amount and the same kind of text: a model that may not
end its answer keeps writing in the same conversation. (Before, our runs ignored EOS instead: the model
ended its turn and wrote a new conversation after it, text that prompt lookup cannot copy, while the peers
held EOS back. Speculative speed-ups depend on the text, so those comparisons were not like for like.)

With `--history`, each ngram configuration also runs with an output history (runtime/output_history.py) that
holds the outputs of the prompts before this one in the file (their plain decode in repeat 0), never this
prompt's own: what a server that answered those requests first would have.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field

from ..errors import SpecedgeError
from ..progress import Progress


class BenchError(SpecedgeError):
    pass


@dataclass
class Config:
    name: str
    proposer: str = "none"  # ours: none | ngram | draft
    gamma: int = 0
    tree: int = 0  # ours: the tree graph T (0: chains)
    history: bool = False  # ours: prompt lookup also drafts from the earlier prompts' outputs
    peer: str | None = None  # a peer system's name
    peer_config: str | None = None


@dataclass
class Run:
    config: str
    prompt: str
    kind: str
    prompt_tokens: int
    tokens: list[int]
    total_ms: float
    ttft_ms: float | None
    itl_ms: float | None = None
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    host_share: float | None = None
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0
    tree_nodes: int = 0
    off_chain_accepted: int = 0
    spare_proposed: int = 0  # guesses in verify steps' padding rows (Stats), in proposed too
    spare_accepted: int = 0


def load_prompts(path: str) -> list[dict]:
    """A JSONL file of {"id", "kind", "messages"} objects (a "prompt" string may replace "messages")."""
    if not os.path.isfile(path):
        raise BenchError(f"prompts file not found: {path}")
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except ValueError as e:
                raise BenchError(f"{path}:{number}: not JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(item, dict) or not ("messages" in item or "prompt" in item):
                raise BenchError(f"{path}:{number}: expected an object with \"messages\" (or \"prompt\")")
            item.setdefault("id", f"prompt-{number}")
            item.setdefault("kind", "open")
            prompts.append(item)
    if not prompts:
        raise BenchError(f"{path} holds no prompts")
    return prompts


def configs_for(proposers: list[str], gammas: list[int], has_draft: bool, trees: list[int] = (),
                history: bool = False) -> list[Config]:
    """Plain decode, each proposer at each gamma as a chain, and as a tree in each tree graph it fits; with
    `history`, each ngram configuration also with the output history."""
    configs = [Config("none")]
    for proposer in proposers:
        if proposer == "none":
            continue
        if proposer not in ("ngram", "draft"):
            raise BenchError(f"unknown proposer {proposer!r} (choose from none, ngram, draft)")
        if proposer == "draft" and not has_draft:
            raise BenchError("proposer 'draft' needs a bundle with a draft model (export with --draft-layers N)")
        configs += [Config(f"{proposer} g={g}", proposer, g) for g in gammas]
        configs += [Config(f"{proposer} g={g} tree={t}", proposer, g, t) for t in trees for g in gammas if g < t]
    if history:
        if "ngram" not in proposers:
            raise BenchError("--history is a prompt lookup option: add ngram to --proposers")
        configs += [Config(f"{c.name} history", c.proposer, c.gamma, c.tree, True) for c in configs
                    if c.proposer == "ngram"]
    return configs


def _median_run(runs: list[Run]) -> Run:
    """The repeat with the median end-to-end time (its other numbers come along)."""
    return sorted(runs, key=lambda r: r.total_ms)[len(runs) // 2]


def summarize(runs: list[Run], configs: list[Config], sampled: bool = False) -> list[dict]:
    """One row per (configuration, prompt kind): throughput over the kind's prompts and medians. Sampled runs
    have no `identical` count (None): their outputs are draws, not plain decode's tokens."""
    by_key: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        by_key.setdefault((r.config, r.prompt), []).append(r)
    medians = [_median_run(v) for v in by_key.values()]
    reference = {m.prompt: m.tokens for m in medians if m.config == "none"}
    rows = []
    kinds = sorted({m.kind for m in medians}) + ["all"]
    for kind in kinds:
        base = None
        for c in configs:
            ms = [m for m in medians if m.config == c.name and (kind == "all" or m.kind == kind)]
            if not ms:
                continue
            new = sum(len(m.tokens) for m in ms)
            seconds = sum(m.total_ms for m in ms) / 1e3
            tps = new / seconds if seconds else 0.0
            if c.name == "none":
                base = tps
            ttfts = [m.ttft_ms for m in ms if m.ttft_ms is not None]
            itls = [m.itl_ms for m in ms if m.itl_ms is not None]
            hosts = [m.host_share for m in ms if m.host_share is not None]
            rounds = sum(m.rounds for m in ms)
            proposed, accepted = sum(m.proposed for m in ms), sum(m.accepted for m in ms)
            width = max((len(m.proposed_by_position) for m in ms), default=0)
            by_pos = []
            for j in range(width):
                p = sum(m.proposed_by_position[j] for m in ms if j < len(m.proposed_by_position))
                a = sum(m.accepted_by_position[j] for m in ms if j < len(m.accepted_by_position))
                by_pos.append(a / p if p else 0.0)
            rows.append({
                "config": c.name, "kind": kind, "prompts": len(ms), "tokens_per_s": tps,
                "speedup": tps / base if base else None,
                "ttft_ms": statistics.median(ttfts) if ttfts else None,
                "itl_ms": statistics.median(itls) if itls else None,
                "tokens_per_round": new / rounds if rounds else None,
                "acceptance": accepted / proposed if proposed else None,
                "acceptance_by_position": by_pos,
                "host_share": statistics.mean(hosts) if hosts else None,
                "draft_ms_per_round": sum(m.draft_ms for m in ms) / rounds if rounds else None,
                "verify_ms_per_round": sum(m.verify_ms for m in ms) / rounds if rounds else None,
                "commit_ms_per_round": sum(m.commit_ms for m in ms) / rounds if rounds else None,
                "guesses": [sum(m.spare_accepted for m in ms), sum(m.spare_proposed for m in ms)],  # accepted, made
                "identical": None if sampled else sum(m.tokens == reference.get(m.prompt) for m in ms),
            })
    return rows


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def render_table(rows: list[dict]) -> str:
    head = ("| kind | configuration | tokens/s | speed-up | TTFT ms | ITL ms | tokens/round | acceptance "
            "| host share | identical |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['config']} | {r['tokens_per_s']:.1f} | {_fmt(r['speedup'], '.2f')}x "
                     f"| {_fmt(r['ttft_ms'], '.0f')} | {_fmt(r['itl_ms'], '.1f')} | {_fmt(r['tokens_per_round'], '.2f')} "
                     f"| {_fmt(r['acceptance'], '.0%')} | {_fmt(r['host_share'], '.1%')} | {_identical(r)} |")
    return "\n".join(lines)


def _identical(row: dict) -> str:
    return "sampled" if row["identical"] is None else f"{row['identical']}/{row['prompts']}"


def render_round_breakdown(rows: list[dict]) -> str:
    """Where a decode round's time goes: drafting, verifying, committing (host) per configuration."""
    lines = ["| configuration | draft ms/round | verify ms/round | commit ms/round | host share of decode "
             "| padding-row guesses accepted / made |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] != "all" or r["verify_ms_per_round"] is None:
            continue
        lines.append(f"| {r['config']} | {r['draft_ms_per_round']:.2f} | {r['verify_ms_per_round']:.2f} "
                     f"| {r['commit_ms_per_round']:.2f} | {_fmt(r['host_share'], '.1%')} "
                     f"| {r['guesses'][0]} / {r['guesses'][1]} |")
    return "\n".join(lines)


def write_plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'specedge[bench]'") from None
    kinds = [k for k in dict.fromkeys(r["kind"] for r in rows) if k != "all"] or ["all"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        values = [next((r["tokens_per_s"] for r in rows if r["config"] == c and r["kind"] == kind), 0) for c in configs]
        ax1.bar([x + i * width for x in range(len(configs))], values, width, label=kind)
    ax1.set_xticks([x + width * (len(kinds) - 1) / 2 for x in range(len(configs))])
    ax1.set_xticklabels(configs, rotation=35, ha="right", fontsize=8)
    ax1.set_ylabel("tokens/s (end to end)")
    ax1.set_title("speed by configuration")
    ax1.legend()
    for r in rows:
        if r["kind"] == "all" and r["acceptance_by_position"]:
            ax2.plot(range(1, len(r["acceptance_by_position"]) + 1), r["acceptance_by_position"], marker="o",
                     label=r["config"])
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    ax2.set_title("acceptance by draft position (all prompts)")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(bundle: str, prompts_path: str, proposers: list[str] | None, gammas: list[int], repeats: int = 3,
              max_new_tokens: int = 128, threads: int | None = 2, compare: list[str] | None = None,
              kinds: list[str] | None = None, limit: int | None = None, backend: str = "cpu",
              peer_model: str | None = None, adaptive: bool = True, trees: list[int] = (),
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
              history: bool = False) -> dict:
    from ..runtime.generator import Generator
    from ..runtime.output_history import OutputHistory
    from ..runtime.sampling import SamplingParams
    from ..runtime.stats import Stats

    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    except ValueError as e:
        raise BenchError(str(e)) from None
    sampled = not params.greedy
    if sampled and compare:
        raise BenchError("--compare runs the peers greedily: drop --temperature to compare with them")
    if repeats < 1:
        raise BenchError("--repeats must be at least 1")
    if any(g < 1 for g in gammas):  # (gamma 0 ran as gamma 4 under the name g=0)
        raise BenchError(f"--gamma values must be at least 1, not {min(gammas)}")
    prompts = load_prompts(prompts_path)
    if kinds:
        prompts = [p for p in prompts if p["kind"] in kinds]
    if limit is not None and limit < 1:
        raise BenchError(f"--limit must be at least 1, not {limit}")
    prompts = prompts[:limit] if limit else prompts
    if not prompts:
        raise BenchError(f"no prompts of kind {', '.join(kinds or [])} in {prompts_path}")
    gen = Generator.load(bundle, backend=backend, threads=threads)
    if gen.tokenizer is None:
        raise BenchError("the bundle has no tokenizer (or the tokenizers package is missing): bench needs text prompts")
    missing = sorted(set(trees) - set(gen.manifest.target.tree_tokens()))
    if missing:
        raise BenchError(f"--trees {missing[0]}: the bundle has no such tree graph (export with --tree)")
    if proposers is None:  # every proposer the bundle can run
        proposers = ["ngram", "draft"] if gen.draft is not None else ["ngram"]
    configs = configs_for(proposers, gammas, gen.draft is not None, trees, history)
    peers = _load_peers(compare or [], gen, bundle, threads, peer_model)
    for peer in peers.values():
        configs += [Config(f"{peer.name} {c}", peer=peer.name, peer_config=c) for c in peer.configs]
    ids = {p["id"]: (gen.tokenizer.apply_chat_template(p["messages"]) if "messages" in p
                     else gen.tokenizer.encode(p["prompt"])) for p in prompts}

    earlier: list[list[int]] = []  # with --history: the outputs of the prompts run so far, in order

    def run_once(c: Config, prompt: dict, n: int, seed: int = seed, before: int = 0) -> Run:
        pid = ids[prompt["id"]]
        # a fresh history of the first `before` prompts' outputs per run: no run sees its own prompt's output
        gen.output_history = OutputHistory.of(earlier[:before]) if c.history else None
        if c.peer:
            out = peers[c.peer].generate(pid, n, c.peer_config)
            return Run(c.name, prompt["id"], prompt["kind"], len(pid), list(out.tokens), out.total_s * 1e3,
                       None if out.ttft_s is None else out.ttft_s * 1e3)
        s = Stats()
        tokens = [t for new in gen.stream(pid, n, proposer=c.proposer, gamma=c.gamma or 4, min_new_tokens=n, stats=s,
                                          adaptive=adaptive, tree=c.tree, temperature=params.temperature,
                                          top_k=params.top_k, top_p=params.top_p, seed=seed) for t in new]
        return Run(c.name, prompt["id"], prompt["kind"], len(pid), tokens, s.total_ms, s.ttft_ms, s.itl_ms,
                   s.rounds, s.proposed, s.accepted, s.proposed_by_position, s.accepted_by_position, s.host_share,
                   s.draft_ms, s.verify_ms, s.commit_ms, s.tree_nodes, s.off_chain_accepted, s.spare_proposed,
                   s.spare_accepted)

    for c in configs:  # warm-up: sessions created, first-run allocations done, before anything is timed
        run_once(c, prompts[0], 8)
    rss_reset = _reset_peak_rss()
    bar = Progress(repeats * len(prompts) * len(configs), "bench", "run")
    runs = []
    started = time.time()
    try:
        for r in range(repeats):
            for i, prompt in enumerate(prompts):
                for c in configs:
                    runs.append(run_once(c, prompt, max_new_tokens, seed + 1000 * r + i, i))
                    bar.update(f"{prompt['id']} {c.name}")
                if r == 0:
                    earlier.append(runs[-len(configs)].tokens)  # plain decode's (configs[0] is "none")
    finally:
        bar.close()
    rows = summarize(runs, configs, sampled)
    memory = memory_report(gen, rss_reset and not peers)
    gen.output_history = None
    return {"bundle": os.path.abspath(bundle), "prompts": prompts_path, "repeats": repeats, "memory": memory,
            "max_new_tokens": max_new_tokens, "threads": threads, "backend": backend, "adaptive": adaptive,
            "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                         "seed": seed} if sampled else None,
            "configs": [c.name for c in configs], "machine": _machine(), "seconds": round(time.time() - started),
            "rows": rows, "runs": [r.__dict__ for r in runs]}


def _load_peers(names: list[str], gen, bundle: str, threads, peer_model: str | None) -> dict:
    if not names:
        return {}
    from .peers import PEERS, PeerUnavailable, load_peer

    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise BenchError(f"unknown peer {unknown[0]!r}; --compare takes {', '.join(PEERS)}")
    model = peer_model or _default_peer_model(gen)
    if model is None:
        raise BenchError("--compare needs the model the bundle was exported from: pass --peer-model PATH")
    cache = os.path.join(_cache_dir(), "peers")
    peers = {}
    for name in names:
        try:
            peers[name] = load_peer(name, model, threads or 0, cache)
        except PeerUnavailable as e:
            raise BenchError(f"--compare {name}: {e}") from None
    return peers


def _default_peer_model(gen) -> str | None:
    """The bundle's source when it is the embedded SmolLM2 GGUF (peers need the original model)."""
    from .demo import smollm2_gguf

    path = smollm2_gguf()
    source = gen.manifest.export.get("target")
    return path if path and source == os.path.basename(path) else None


def _cache_dir() -> str:
    from .demo import cache_dir

    return cache_dir()


def _reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (Linux), so the peak covers the timed runs only."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_report(gen, measured: bool = True) -> dict:
    """Peak RSS (since the kernel's counter was last reset: bench resets it before the timed runs) against the
    bytes that must be resident, weights plus KV caches; private and file-backed memory as they are now."""
    weights = sum(os.path.getsize(os.path.join(gen.bundle_dir, w)) for w in {m.weights for m in gen.manifest.models.values()})
    cache = gen.target.cache.resident_bytes + (gen.draft.cache.resident_bytes if gen.draft else 0)
    out = {"weights_mb": round(weights / 2**20, 1), "cache_mb": round(cache / 2**20, 1)}
    if measured:
        status = {line.split(":")[0]: int(line.split()[1]) / 1024 for line in open("/proc/self/status")
                  if line.startswith(("VmHWM", "RssAnon", "RssFile"))}
        base = (weights + cache) / 2**20
        # File-backed pages are clean page cache (shared, reclaimable): the libraries, and mostly embedding
        # rows, which the kernel maps a block at a time around each Gather (a whole large folio on recent
        # kernels, benchmarks/quant/README.md). Private memory is the rest.
        out.update(peak_rss_mb=round(status["VmHWM"], 1), ratio=round(status["VmHWM"] / base, 2),
                   private_mb=round(status["RssAnon"], 1), private_ratio=round(status["RssAnon"] / base, 2),
                   file_backed_mb=round(status["RssFile"], 1))
    return out


def _machine() -> str:
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}, Python {platform.python_version()}"
