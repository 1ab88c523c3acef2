"""The graph contract: the one definition of every step graph's inputs and outputs.

The exporter writes graphs with exactly these names, shapes and dtypes; the runtime binds its buffers by
them; `specedge check` and the tests validate against them. A C/C++ port implements the same table
(docs/bundle.md spells it out in prose).

A *step graph* processes T new tokens of a batch of B sequences against a past of S cache slots:

  inputs   input_ids     int64  [B, T]             the tokens of this step
           position_ids  int64  [B, T]             their positions (the host computes them)
           cache_len     int64  [B]                valid slots of the past; slots >= cache_len are masked
           past_key_i    cache  [B, H_kv, S, D]    per layer i, the runtime's cache buffers (read only)
           past_value_i  cache  [B, H_kv, S, D]
           step_mask     bool   [B, T, T]          optional: which step tokens see which (tree verify)
  outputs  logits        float32 [B, T, V]         step graphs only; prefill graphs have none
           new_key_i     cache  [B, H_kv, T, D]    the K/V of this step's tokens only
           new_value_i   cache  [B, H_kv, T, D]

"cache" is the model's dtype (float32 or float16); logits are always float32.

Preconditions and guarantees (bundle format 2, docs/bundle.md): cache_len + T <= S for every row, padding
rows included; row t of a T-token step equals, bit for bit, a one-token step on the same token at slot
cache_len + t (what makes greedy speculation exact; `specedge check` verifies it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

OPSET = 17  # Ascend's ONNX coverage targets opset 17; TensorRT and QNN accept it.

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
CACHE_LEN = "cache_len"
STEP_MASK = "step_mask"
LOGITS = "logits"

# Graph roles. A prefill graph only fills the cache: the runtime keeps the prompt's last token pending and
# reads its logits from the first decode/verify step, so a prefill chunk never needs an LM head.
PREFILL = "prefill"
STEP = "step"
ROLES = (PREFILL, STEP)

DTYPES = ("float32", "float16")


def past_key(i: int) -> str:
    return f"past_key_{i}"


def past_value(i: int) -> str:
    return f"past_value_{i}"


def new_key(i: int) -> str:
    return f"new_key_{i}"


def new_value(i: int) -> str:
    return f"new_value_{i}"


@dataclass(frozen=True)
class ModelDims:
    """The numbers that fix every shape of a model's step graphs."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    context: int  # S, cache slots per sequence
    batch: int  # B
    dtype: str  # of weights, cache and activations; logits are float32

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ModelDims":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.num_kv_heads, self.context, self.head_dim)

    def new_kv_shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (self.batch, self.num_kv_heads, tokens, self.head_dim)

    @property
    def cache_bytes(self) -> int:
        """Bytes of one model's K and V buffers over all layers."""
        b, h, s, d = self.cache_shape
        return 2 * self.num_layers * b * h * s * d * (2 if self.dtype == "float16" else 4)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: int64, float32, float16, bool
    shape: tuple[int, ...]


def step_inputs(dims: ModelDims, tokens: int, step_mask: bool = False, context: int | None = None) -> list[TensorSpec]:
    """Inputs of a step graph; `context` is the graph's past length S (a bucket <= dims.context)."""
    b = dims.batch
    past = dims.cache_shape if context is None else (b, dims.num_kv_heads, context, dims.head_dim)
    specs = [
        TensorSpec(INPUT_IDS, "int64", (b, tokens)),
        TensorSpec(POSITION_IDS, "int64", (b, tokens)),
        TensorSpec(CACHE_LEN, "int64", (b,)),
    ]
    for i in range(dims.num_layers):
        specs.append(TensorSpec(past_key(i), dims.dtype, past))
        specs.append(TensorSpec(past_value(i), dims.dtype, past))
    if step_mask:
        specs.append(TensorSpec(STEP_MASK, "bool", (b, tokens, tokens)))
    return specs


def step_outputs(dims: ModelDims, tokens: int, role: str = STEP) -> list[TensorSpec]:
    specs = []
    if role == STEP:
        specs.append(TensorSpec(LOGITS, "float32", (dims.batch, tokens, dims.vocab_size)))
    for i in range(dims.num_layers):
        specs.append(TensorSpec(new_key(i), dims.dtype, dims.new_kv_shape(tokens)))
        specs.append(TensorSpec(new_value(i), dims.dtype, dims.new_kv_shape(tokens)))
    return specs
