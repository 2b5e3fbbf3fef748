"""Chunking: the units a prompt is cached as, engine-neutral.

A prompt is cut into *units*: full chunks of `chunk_size` tokens, chained by
prefix keys (shmkv.keys), and, when a piece size is given, one *piece*: the
piece-aligned part of the last, incomplete chunk (the piece size is the
engine's block size: vLLM can only use whole blocks). Pieces give hits as
fine as vLLM's own prefix cache at the prompt's tail (a 3,000-token prompt
with 128-token blocks hits 2,944 tokens, not 2,816). Nothing chains after a
piece.

Keys are computed per tensor-parallel rank: one namespace root per rank,
`Unit.keys[r]` is rank r's key (each rank stores its own shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shmkv.keys import ExtraInputs, chunk_keys, piece_key


@dataclass(frozen=True)
class Unit:
    """A stored unit of a prompt: a full chunk or the tail piece."""

    start: int
    end: int
    keys: tuple[bytes, ...]  # one per TP rank

    @property
    def tokens(self) -> int:
        return self.end - self.start


class Chunker:
    """Units of prompts for one namespace root per TP rank."""

    def __init__(self, roots: Sequence[bytes], chunk_size: int, piece_size: int | None = None):
        """`piece_size`: granularity of the tail piece (None: full chunks only)."""
        if not roots:
            raise ValueError("need one namespace root per TP rank")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
        if piece_size is not None and (piece_size <= 0 or chunk_size % piece_size):
            raise ValueError(f"chunk_size {chunk_size} must be a multiple of the piece size {piece_size}")
        self.roots = tuple(roots)
        self.chunk_size = chunk_size
        self.piece_size = piece_size

    def units(self, tokens: Sequence[int] | np.ndarray, extras: ExtraInputs | None = None) -> list[Unit]:
        """Full chunks, then the tail piece (if any whole piece remains)."""
        per_rank = [chunk_keys(root, tokens, self.chunk_size, extras) for root in self.roots]
        units = [Unit(s, e, tuple(r[i][2] for r in per_rank)) for i, (s, e, _) in enumerate(per_rank[0])]
        if self.piece_size:
            start = len(units) * self.chunk_size
            n = (len(tokens) - start) // self.piece_size
            if n > 0:
                units.append(self._piece(tokens, start, start + n * self.piece_size,
                                         units[-1].keys if units else self.roots, extras))
        return units

    def piece_candidates(self, tokens: Sequence[int] | np.ndarray, start: int, prev: tuple[bytes, ...],
                         extras: ExtraInputs | None = None) -> list[Unit]:
        """Pieces that could extend a hit of full chunks ending at `start`
        (whose last keys are `prev`), longest first."""
        if not self.piece_size:
            return []
        out = []
        for m in range(self.chunk_size // self.piece_size - 1, 0, -1):
            end = start + m * self.piece_size
            if end <= len(tokens):
                out.append(self._piece(tokens, start, end, prev, extras))
        return out

    @staticmethod
    def _piece(tokens: Sequence[int] | np.ndarray, start: int, end: int, prev: tuple[bytes, ...],
               extras: ExtraInputs | None) -> Unit:
        ex = extras.for_range(start, end) if extras is not None else b""
        return Unit(start, end, tuple(piece_key(p, tokens[start:end], ex) for p in prev))
