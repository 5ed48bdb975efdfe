"""KV geometry: pure arithmetic, no I/O, no engine imports.

Offers ``DType`` and ``AttentionKind`` (enums), ``KVGeometry`` (what one token's KV looks
like, with MLA, sliding window, TP and PP), ``bytes_per_token`` / ``bytes_per_request`` (the
seed's formula ``2 x L x Hkv x d x b`` and its variants), the page/chunk helpers
``round_up_tokens``, ``validate_chunk_size``, ``pages_per_chunk`` and ``ChunkShape`` (one
engine's chunk geometry), and ``format_bytes``; the capacity planner over it is
``kvstore.layout.capacity`` (``plan_capacity`` returning a ``CapacityReport``).  It is
stateless and used on every side (scheduler, worker, server, CLI).  Every bad input raises
``ConfigError`` naming the field.

Rules (docs/architecture.md#kv-geometry-and-capacity):
  * MHA / GQA / MQA cache K and V: ``2 x kv_heads x head_dim`` elements per layer per token.
    MHA is GQA with ``q_heads == kv_heads``; MQA is ``kv_heads == 1``.
  * MLA caches ONE vector per layer per token of ``kv_lora_rank + qk_rope_head_dim``
    elements (no factor 2).  Build it with ``KVGeometry.mla``; it stores kv_heads=1 and
    head_dim=latent+rope.  The latent is shared by all heads, so TP replicates it.
  * Sliding window: ``sliding_layers`` layers (all layers when None) keep at most
    ``sliding_window`` tokens; the other layers keep every token.
  * TP: a rank holds ``ceil(kv_heads / tp)`` KV heads.  When tp divides kv_heads this is the
    exact split ``kv_heads / tp``; otherwise heads are replicated so every rank holds whole
    heads (kv_heads=8, tp=16 -> 1 per rank; kv_heads=6, tp=4 -> 2 per rank).
  * PP: the largest stage holds ``ceil(layers / pp)`` layers; ``pp > layers`` is rejected.
    With sliding layers, per-rank figures are the worst case: the largest stage is assumed
    to hold full-attention layers first.
  * Page rounding: per request and per layer, retained tokens are rounded up to a multiple
    of ``block_size`` (full layers: ``tokens``; sliding layers: ``min(tokens, window)``).
    Tail waste = page-rounded bytes - exact bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from kvstore.errors import ConfigError


class DType(Enum):
    """Element type of the cached K/V (or MLA latent)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"

    @property
    def nbytes(self) -> int:
        return _DTYPE_BYTES[self]

    @classmethod
    def parse(cls, name: str) -> DType:
        try:
            return cls(str(name).strip().lower())
        except ValueError as err:
            valid = ", ".join(d.value for d in cls)
            raise ConfigError(f"unknown dtype {name!r}; expected one of {valid}") from err


_DTYPE_BYTES = {DType.FP32: 4, DType.BF16: 2, DType.FP16: 2, DType.FP8: 1}


class AttentionKind(Enum):
    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"


def _require_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ConfigError(f"{name} must be {kind} integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Shape of one token's KV across a model, and how TP/PP shard it."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: DType
    q_heads: int | None = None  # only labels MHA vs GQA; bytes do not depend on it
    kv_lora_rank: int = 0  # MLA latent dim; 0 = not MLA
    qk_rope_head_dim: int = 0  # MLA decoupled rope dim
    sliding_window: int | None = None  # tokens kept by sliding-window layers
    sliding_layers: int | None = None  # how many layers use the window; None = all
    tp: int = 1
    pp: int = 1
    recurrent_layers: int = 0  # hybrid models' Mamba / linear-attention layers (beside `layers`)
    state_bytes: int = 0  # the fixed state one recurrent layer keeps per request

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tp", "pp"):
            _require_int(name, getattr(self, name))
        if not isinstance(self.dtype, DType):
            raise ConfigError(f"dtype must be a DType, got {self.dtype!r}")
        if self.pp > self.layers:
            raise ConfigError(f"pp {self.pp} exceeds layers {self.layers}: a stage would hold no layers")
        self._check_q_heads()
        self._check_mla()
        self._check_window()
        _require_int("recurrent_layers", self.recurrent_layers, 0)
        _require_int("state_bytes", self.state_bytes, 0)
        if bool(self.recurrent_layers) != bool(self.state_bytes):
            raise ConfigError("recurrent_layers and state_bytes go together (a fixed state per layer)")

    @classmethod
    def mla(cls, layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: DType, **kwargs: Any) -> KVGeometry:
        """An MLA geometry: one (latent + rope) vector per layer per token."""
        _require_int("kv_lora_rank", kv_lora_rank)
        _require_int("qk_rope_head_dim", qk_rope_head_dim, 0)
        return cls(
            layers,
            1,
            kv_lora_rank + qk_rope_head_dim,
            dtype,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            **kwargs,
        )

    def _check_q_heads(self) -> None:
        if self.q_heads is None:
            return
        _require_int("q_heads", self.q_heads)
        if not self.is_mla and self.q_heads % self.kv_heads:
            raise ConfigError(f"q_heads {self.q_heads} must be a multiple of kv_heads {self.kv_heads}")

    def _check_mla(self) -> None:
        _require_int("kv_lora_rank", self.kv_lora_rank, 0)
        _require_int("qk_rope_head_dim", self.qk_rope_head_dim, 0)
        if self.qk_rope_head_dim and not self.kv_lora_rank:
            raise ConfigError("qk_rope_head_dim needs kv_lora_rank (the MLA latent dim)")
        want = self.kv_lora_rank + self.qk_rope_head_dim
        if self.is_mla and (self.kv_heads != 1 or self.head_dim != want):
            raise ConfigError(
                f"MLA caches one latent+rope vector per layer: expected kv_heads=1 and "
                f"head_dim={want}, got kv_heads={self.kv_heads} head_dim={self.head_dim}"
            )

    def _check_window(self) -> None:
        if self.sliding_window is None:
            if self.sliding_layers is not None:
                raise ConfigError("sliding_layers needs sliding_window")
            return
        _require_int("sliding_window", self.sliding_window)
        if self.sliding_layers is not None:
            _require_int("sliding_layers", self.sliding_layers)
            if self.sliding_layers > self.layers:
                raise ConfigError(f"sliding_layers {self.sliding_layers} exceeds layers {self.layers}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kind(self) -> AttentionKind:
        """MLA, MQA (1 KV head), MHA (q_heads == kv_heads), else GQA (also when q_heads unknown)."""
        if self.is_mla:
            return AttentionKind.MLA
        if self.kv_heads == 1:
            return AttentionKind.MQA
        return AttentionKind.MHA if self.q_heads == self.kv_heads else AttentionKind.GQA

    @property
    def kv_factor(self) -> int:
        """2 for separate K and V; 1 for MLA's single latent vector."""
        return 1 if self.is_mla else 2

    @property
    def heads_per_rank(self) -> int:
        return math.ceil(self.kv_heads / self.tp)

    @property
    def tp_replicated(self) -> bool:
        """True when TP ranks hold copies of the same heads instead of an exact split."""
        return self.heads_per_rank * self.tp > self.kv_heads

    @property
    def layers_per_stage(self) -> int:
        return math.ceil(self.layers / self.pp)

    @property
    def window_layers(self) -> int:
        if self.sliding_window is None:
            return 0
        return self.layers if self.sliding_layers is None else self.sliding_layers

    def to_dict(self) -> dict[str, Any]:
        return {
            "attention": self.kind.value,
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "dtype": self.dtype.value,
            "sliding_layers": self.window_layers,
            "heads_per_rank": self.heads_per_rank,
            "tp_replicated": self.tp_replicated,
            "layers_per_stage": self.layers_per_stage,
        }


def _layer_token_bytes(g: KVGeometry, per_rank: bool) -> int:
    heads = g.heads_per_rank if per_rank else g.kv_heads
    return g.kv_factor * heads * g.head_dim * g.dtype.nbytes


def _layer_split(g: KVGeometry, per_rank: bool) -> tuple[int, int]:
    """(full-attention layers, sliding-window layers) in scope: the model or its largest stage."""
    full, sliding = g.layers - g.window_layers, g.window_layers
    if not per_rank:
        return full, sliding
    full_in_stage = min(g.layers_per_stage, full)  # worst case: full layers first
    return full_in_stage, g.layers_per_stage - full_in_stage


def bytes_per_token(g: KVGeometry, *, per_rank: bool = False) -> int:
    """KV bytes one token adds to every layer (before any window applies).

    ``per_rank=False``: one logical copy of the model's KV.  ``per_rank=True``: the largest
    TP x PP rank (heads_per_rank heads, layers_per_stage layers).
    """
    full, sliding = _layer_split(g, per_rank)
    return (full + sliding) * _layer_token_bytes(g, per_rank)


def round_up_tokens(tokens: int, block_size: int) -> int:
    _require_int("tokens", tokens)
    _require_int("block_size", block_size)
    return -(-tokens // block_size) * block_size


def bytes_per_request(g: KVGeometry, tokens: int, *, per_rank: bool = False, block_size: int | None = None) -> int:
    """KV bytes retained by one request of ``tokens`` tokens; page-rounded if block_size
    given.  Full-attention layers keep every token, sliding-window layers at most their
    window, recurrent layers a fixed state whatever the length."""
    _require_int("tokens", tokens)
    full, sliding = _layer_split(g, per_rank)
    kept_full, kept_window = tokens, min(tokens, g.sliding_window or tokens)
    if block_size is not None:
        kept_full = round_up_tokens(kept_full, block_size)
        kept_window = round_up_tokens(kept_window, block_size)
    return _layer_token_bytes(g, per_rank) * (full * kept_full + sliding * kept_window) + state_bytes(g, per_rank)


def state_bytes(g: KVGeometry, per_rank: bool = False) -> int:
    """The recurrent layers' fixed state of one request (per rank: split over TP, layers over PP)."""
    if not g.recurrent_layers:
        return 0
    if not per_rank:
        return g.recurrent_layers * g.state_bytes
    return math.ceil(g.recurrent_layers / g.pp) * math.ceil(g.state_bytes / g.tp)


def validate_chunk_size(chunk_size: int, block_size: int) -> None:
    """A chunk must cover whole pages: a positive multiple of the engine's block size."""

    def is_pos(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if not (is_pos(block_size) and is_pos(chunk_size) and chunk_size % block_size == 0):
        why = "" if is_pos(block_size) else " (block_size must be a positive integer)"
        raise ConfigError(f"chunk_size {chunk_size!r} must be a positive multiple of block_size {block_size!r}{why}")


def pages_per_chunk(chunk_size: int, block_size: int) -> int:
    validate_chunk_size(chunk_size, block_size)
    return chunk_size // block_size


@dataclass(frozen=True, slots=True)
class ChunkShape:
    """The one chunk geometry of an engine: ``chunk_size`` tokens per chunk object, the
    engine's ``block_size`` tokens per page, and ``pages`` per chunk (checked at
    construction: a chunk covers whole pages)."""

    chunk_size: int
    block_size: int

    def __post_init__(self) -> None:
        validate_chunk_size(self.chunk_size, self.block_size)

    @property
    def pages(self) -> int:
        return self.chunk_size // self.block_size

    def whole_blocks(self, tokens: int) -> int:
        """``tokens`` rounded down to whole blocks (pages), in tokens."""
        return tokens // self.block_size * self.block_size


def format_bytes(n: int) -> str:
    """Binary units: ``1073741824`` -> ``'1.00 GiB'``; below 1 KiB, plain bytes."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    power = 0
    while power + 1 < len(units) and n >= 1024 ** (power + 1):
        power += 1
    return f"{n} B" if power == 0 else f"{n / 1024**power:.2f} {units[power]}"
