"""The capacity planner behind ``kvstore capacity``: how much KV a model's requests hold,
per logical copy and on its largest rank, with page rounding and tail waste
(``plan_capacity`` returning a ``CapacityReport``).  Pure arithmetic over
``kvstore.layout``'s geometry; every bad input raises ``ConfigError`` naming the field."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvstore.layout import (
    KVGeometry,
    _require_int,
    bytes_per_request,
    bytes_per_token,
    format_bytes,
    pages_per_chunk,
    round_up_tokens,
    validate_chunk_size,
)


@dataclass(frozen=True, slots=True)
class Footprint:
    """KV bytes for one scope: the whole model (one logical copy) or its largest rank."""

    bytes_per_token: int
    bytes_per_request: int
    total_bytes: int
    page_rounded_bytes: int

    @property
    def tail_waste_bytes(self) -> int:
        return self.page_rounded_bytes - self.total_bytes

    def to_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "tail_waste_bytes": self.tail_waste_bytes}


def _footprint(g: KVGeometry, tokens: int, requests: int, block_size: int, per_rank: bool) -> Footprint:
    per_request = bytes_per_request(g, tokens, per_rank=per_rank)
    rounded = bytes_per_request(g, tokens, per_rank=per_rank, block_size=block_size)
    return Footprint(bytes_per_token(g, per_rank=per_rank), per_request, per_request * requests, rounded * requests)


@dataclass(frozen=True, slots=True)
class CapacityReport:
    """Capacity of ``requests`` unshared requests of ``tokens`` tokens each, with its inputs.

    ``model`` is one logical copy of the KV; ``per_rank`` is the largest TP x PP rank.
    Weights, workspace and in-flight copies are not included.
    """

    geometry: KVGeometry
    tokens: int
    requests: int
    block_size: int
    model: Footprint
    per_rank: Footprint
    chunk_size: int | None = None

    bytes_per_token = property(lambda self: self.model.bytes_per_token)
    bytes_per_request = property(lambda self: self.model.bytes_per_request)
    total_bytes = property(lambda self: self.model.total_bytes)
    page_rounded_bytes = property(lambda self: self.model.page_rounded_bytes)
    tail_waste_bytes = property(lambda self: self.model.tail_waste_bytes)

    @property
    def rounded_tokens(self) -> int:
        return round_up_tokens(self.tokens, self.block_size)

    @property
    def pages_per_chunk(self) -> int | None:
        return None if self.chunk_size is None else pages_per_chunk(self.chunk_size, self.block_size)

    @property
    def chunk_bytes(self) -> int | None:
        """Bytes of one chunk object on the largest rank: every layer of chunk_size tokens."""
        return None if self.chunk_size is None else self.per_rank.bytes_per_token * self.chunk_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "geometry": self.geometry.to_dict(),
            "tokens": self.tokens,
            "requests": self.requests,
            "block_size": self.block_size,
            "rounded_tokens": self.rounded_tokens,
            "tail_tokens": self.rounded_tokens - self.tokens,
            **self.model.to_dict(),
            "per_rank": self.per_rank.to_dict(),
            "chunk_size": self.chunk_size,
            "pages_per_chunk": self.pages_per_chunk,
            "chunk_bytes": self.chunk_bytes,
        }

    def format(self) -> str:
        """Human report: exact byte counts with binary units alongside."""
        g = self.geometry
        lines = [
            f"geometry      {_describe(g)}",
            f"requests      {self.requests} x {self.tokens} tokens, block {self.block_size}"
            f" -> {self.rounded_tokens} tokens page-rounded"
            f" ({self.rounded_tokens - self.tokens} tail tokens per request)",
        ]
        lines += _footprint_lines("model (one copy)", self.model)
        lines += _footprint_lines(
            f"per rank (tp={g.tp} pp={g.pp}: {g.heads_per_rank} heads"
            f"{' replicated' if g.tp_replicated else ''},"
            f" {g.layers_per_stage} layers)",
            self.per_rank,
        )
        if self.chunk_size is not None:
            lines.append(
                f"chunk         {self.chunk_size} tokens = {self.pages_per_chunk} pages,"
                f" {_bytes(self.chunk_bytes or 0)} per rank"
            )
        return "\n".join(lines)


def _bytes(n: int) -> str:
    return f"{n} B ({format_bytes(n)})"


def _describe(g: KVGeometry) -> str:
    shape = (
        f"latent {g.kv_lora_rank} + rope {g.qk_rope_head_dim}"
        if g.is_mla
        else f"kv_heads {g.kv_heads} x head_dim {g.head_dim}"
    )
    text = f"{g.kind.name}, {g.layers} layers, {shape}, {g.dtype.value}"
    if g.sliding_window is not None:
        text += f", window {g.sliding_window} on {g.window_layers} layers"
    if g.recurrent_layers:
        text += f", {g.recurrent_layers} recurrent layers of {g.state_bytes} state bytes"
    return text


def _footprint_lines(title: str, f: Footprint) -> list[str]:
    return [
        title,
        f"  per token           {_bytes(f.bytes_per_token)}",
        f"  per request         {_bytes(f.bytes_per_request)}",
        f"  total               {_bytes(f.total_bytes)}",
        f"  page-rounded total  {_bytes(f.page_rounded_bytes)}",
        f"  tail waste          {_bytes(f.tail_waste_bytes)}",
    ]


def plan_capacity(
    g: KVGeometry, *, tokens: int, requests: int = 1, block_size: int = 16, chunk_size: int | None = None
) -> CapacityReport:
    """KV capacity of ``requests`` unshared requests holding ``tokens`` tokens each."""
    for name, value in (("tokens", tokens), ("requests", requests), ("block_size", block_size)):
        _require_int(name, value)
    if chunk_size is not None:
        validate_chunk_size(chunk_size, block_size)
    return CapacityReport(
        g,
        tokens,
        requests,
        block_size,
        _footprint(g, tokens, requests, block_size, per_rank=False),
        _footprint(g, tokens, requests, block_size, per_rank=True),
        chunk_size,
    )
