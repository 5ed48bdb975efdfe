"""Where a request's hit is: its full chunks across the tiers, then a tail after them.
Scheduler side (``connector.scheduler``).

A *tail* object holds the whole blocks of a prompt's last, partial chunk, under its own key
(``keys.chunk_hashes`` hashes a partial chunk with its own kind and length, so it never
collides with a full chunk).  After the last full chunk a lookup hits, the longest tail at
that place that the store holds extends the hit, so a repeat hits every whole block but the
one holding its last token, and a prompt that extends an earlier one (the next turn of a
chat) hits through the earlier one's tail.  Tail keys cost one batched presence query.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from connector.ioloop import IOLoop
from connector.requests import Piece, ReqState
from kvstore.keys import ROOT, ObjectKey, chunk_hashes, object_keys
from kvstore.layout import ChunkShape
from kvstore.store.tiered import TieredStore

STATE_TAG = "state"  # the object tag of a recurrent-state snapshot (beside the chunk's "r0")


def state_key(key: ObjectKey) -> ObjectKey:
    """The key of the recurrent state at the end of the chunk or tail object ``key``: the
    state at token t depends on the whole prefix, so it is keyed by the same chain hash."""
    return ObjectKey(key.namespace, key.chunk_hash, STATE_TAG)


class HitFinder:
    def __init__(self, store: TieredStore, io: IOLoop, shape: ChunkShape, object_size: Callable[[int], int]) -> None:
        self.store, self.io = store, io
        self.chunk_size, self.block_size = shape.chunk_size, shape.block_size
        self.pages_per_chunk = shape.pages
        self.object_size = object_size  # pages per layer -> object bytes
        self.chunk_bytes = object_size(self.pages_per_chunk)

    def tail_keys(self, st: ReqState, index: int, tokens: Sequence[int] | None = None) -> list[ObjectKey]:
        """Keys of the tail objects at chunk ``index`` of ``tokens`` (default: the prompt):
        its first k whole blocks, for k from the most there are (at most a chunk less one
        block) down to 1.  Cached per chunk index for the prompt."""
        cached = tokens is None
        keys = st.tails.get(index) if cached else None
        if keys is None:
            seq = st.view.prompt if tokens is None else tokens
            c, bs = self.chunk_size, self.block_size
            most = min(self.pages_per_chunk - 1, (len(seq) - index * c) // bs)
            part = np.asarray(seq[index * c : index * c + most * bs], dtype=np.int64)
            parent = self.parent_hash(st, index)
            start = index * c
            keys = [
                object_keys(
                    st.namespace,
                    chunk_hashes(
                        st.namespace,
                        part[: k * bs],
                        c,
                        include_partial=True,
                        parent=parent,
                        extra_keys=[st.view.extras(start, start + k * bs)],
                    ),
                )[0]
                for k in range(most, 0, -1)
            ]
            if cached:
                st.tails[index] = keys
        return keys

    def extend_keys(self, st: ReqState, chunks: int) -> None:
        """Key the full chunks of the request's tokens so far (prompt and generated) up to
        ``chunks``: a chat's answer is saved, and hit by the next turn, like its prompt."""
        have, tokens = len(st.keys), st.view.all_tokens
        chunks = min(chunks, len(tokens) // self.chunk_size)
        if chunks <= have:
            return
        c = self.chunk_size
        part = np.asarray(tokens[have * c : chunks * c], dtype=np.int64)
        hashes = chunk_hashes(
            st.namespace, part, c, parent=self.parent_hash(st, have), extra_keys=st.view.chunk_extras(have, chunks, c)
        )
        st.hashes = [*st.hashes, *hashes]
        st.keys = [*st.keys, *object_keys(st.namespace, hashes)]

    @staticmethod
    def parent_hash(st: ReqState, index: int):
        return st.hashes[index - 1] if index else ROOT

    def find(self, st: ReqState) -> list[Piece]:
        """The contiguous hit: full chunks, then the longest tail found after them."""
        found = self.io.run(self.store.lookup(st.keys, sized=False))
        c = self.chunk_size
        pieces = [
            Piece(key, i * c, (i + 1) * c, self.chunk_bytes, tier)
            for i, (key, tier) in enumerate(zip(st.keys, found.tiers))
        ]
        tail = self._find_tail(st, found.hits)
        if tail is not None:
            pieces.append(tail)
        for p in pieces:
            st.origin.setdefault(p.key, p.tier)
        return pieces

    def _find_tail(self, st: ReqState, index: int) -> Piece | None:
        bs, c = self.block_size, self.chunk_size
        usable = ((len(st.view.prompt) - 1) // bs * bs - index * c) // bs  # the last token is computed
        if self.pages_per_chunk == 1 or usable < 1:
            return None
        keys = self.tail_keys(st, index)
        keys = keys[max(0, len(keys) - usable) :]  # at most `usable` blocks
        present = self.io.run(self.store.present(keys))
        for key, there in zip(keys, present):
            if there:
                found = self.io.run(self.store.lookup([key], sized=False))
                if found.hits:
                    k = len(keys) - keys.index(key)
                    return Piece(key, index * c, index * c + k * bs, self.object_size(k), found.tiers[0])
        return None

    def boundary_key(self, st: ReqState, t: int) -> ObjectKey | None:
        """The key of the object whose last token is prompt token ``t - 1`` (a full chunk, or
        the tail of ``t % chunk`` tokens), None where no object ends there."""
        c, bs = self.chunk_size, self.block_size
        if t <= 0 or t % bs or t > len(st.view.prompt):
            return None
        if t % c == 0:
            return st.keys[t // c - 1] if t // c <= len(st.keys) else None
        keys = self.tail_keys(st, t // c)
        k = (t % c) // bs
        return keys[len(keys) - k] if len(keys) >= k else None

    def with_state(self, st: ReqState, pieces: list[Piece], state_bytes: int, after: int) -> list[Piece]:
        """Recurrent hybrids: a hit must end where a state snapshot is stored, and carries it.
        The deepest block boundary past ``after`` (the engine's own hit) inside ``pieces``
        and before the prompt's last token whose snapshot the store holds; the pieces cut
        there, then the snapshot as a piece of no tokens.  No snapshot: no hit."""
        bs = self.block_size
        reach = min(pieces[-1].end if pieces else 0, (len(st.view.prompt) - 1) // bs * bs)
        maybe = {t: self.boundary_key(st, t) for t in range(reach, after, -bs)}
        bases = {t: base for t, base in maybe.items() if base is not None}
        bounds = list(bases)
        if not bounds:
            return []
        keys = [state_key(bases[t]) for t in bounds]
        present = self.io.run(self.store.present(keys))
        for t, key, there in zip(bounds, keys, present):
            if not there:
                continue
            found = self.io.run(self.store.lookup([key], sized=False))
            if not found.hits:
                continue
            cut = [p if p.end <= t else Piece(p.key, p.start, t, p.nbytes, p.tier) for p in pieces if p.start < t]
            st.origin.setdefault(key, found.tiers[0])
            return [*cut, Piece(key, t, t, state_bytes, found.tiers[0], state=True)]
        return []

    def extensions(self, st: ReqState, end: int) -> list[ObjectKey]:
        """Keys of the objects that could extend a hit ending at token ``end``: the next full
        chunk and the tails at its place (none after a tail: a hit ends there)."""
        c = self.chunk_size
        if end % c or end >= len(st.view.prompt):
            return []
        index = end // c
        nxt = st.keys[index : index + 1]
        return nxt + (self.tail_keys(st, index) if self.pages_per_chunk > 1 else [])
