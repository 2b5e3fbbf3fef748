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

With a lossy form (an engine that opted in to lossy KV), every unit is keyed
by shmkv.keys.lossy_key of its exact key, and tagged with the lossy root;
the chain itself (what the next unit and the tail piece hash from) stays the
exact one, in `Unit.links`.

With a lookahead of L tokens (an engine whose speculative-decoding drafter,
EAGLE or MTP, wrote the KV of a position from the tokens after it), every
unit is keyed by shmkv.keys.lookahead_key of its exact key and the L tokens
after its end, again chaining from the exact key: two prompts that share a
chunk but not the token after it never share the drafter's KV of that
chunk. A unit whose L following tokens are not all in `tokens` is not made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmkv.keys import ExtraInputs, check_chunk_size, chunk_keys, lookahead_key, lossy_key, piece_key, state_key


@dataclass(frozen=True)
class Unit:
    """A stored unit of a prompt: a full chunk or the tail piece."""

    start: int
    end: int
    keys: tuple[bytes, ...]  # one per TP rank
    links: tuple[bytes, ...] | None = None  # the exact keys later units chain from (None: `keys`)
    state: bool = False  # the recurrent state after `end` (start == end), not attention KV

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def chain(self) -> tuple[bytes, ...]:
        return self.keys if self.links is None else self.links

    def state_unit(self) -> Unit:
        """The entry of the recurrent state after this unit's last token (shmkv.keys.state_key)."""
        return Unit(self.end, self.end, tuple(state_key(k) for k in self.keys), state=True)


class Chunker:
    """Units of prompts for one namespace root per TP rank."""

    def __init__(self, roots: Sequence[bytes], chunk_size: int, piece_size: int | None = None,
                 lossy_form: str | None = None, lookahead: int = 0):
        """`piece_size`: granularity of the tail piece (None: full chunks only);
        `lossy_form`: key units as that lossy form of the exact chunks;
        `lookahead`: key units with that many tokens after their end too."""
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.lookahead = lookahead
        if not roots:
            raise ValueError("need one namespace root per TP rank")
        check_chunk_size(chunk_size)
        if piece_size is not None and (piece_size <= 0 or chunk_size % piece_size):
            raise ValueError(f"chunk_size {chunk_size} must be a multiple of the piece size {piece_size}")
        self.chain_roots = tuple(roots)  # what the first unit hashes from
        self.lossy_form = lossy_form
        self.roots = tuple(lossy_key(r, lossy_form) for r in roots) if lossy_form else self.chain_roots  # tags
        self.chunk_size = chunk_size
        self.piece_size = piece_size

    def units(self, tokens: Sequence[int] | np.ndarray, extras: ExtraInputs | None = None) -> list[Unit]:
        """Full chunks, then the tail piece (if any whole piece remains)."""
        per_rank = [chunk_keys(root, tokens, self.chunk_size, extras) for root in self.chain_roots]
        chunks = [self._unit(s, e, tuple(r[i][2] for r in per_rank), tokens, extras)
                  for i, (s, e, _) in enumerate(per_rank[0])]
        units = [u for u in chunks if u is not None]  # only the last chunk can lack its lookahead
        if self.piece_size and len(units) == len(chunks):
            start = len(units) * self.chunk_size
            n = (len(tokens) - self.lookahead - start) // self.piece_size
            if n > 0:
                units.append(self._piece(tokens, start, start + n * self.piece_size,
                                         units[-1].chain if units else self.chain_roots, extras))
        return units

    def _unit(self, start: int, end: int, exact: tuple[bytes, ...], tokens: Sequence[int] | np.ndarray,
              extras: ExtraInputs | None) -> Unit | None:
        """The unit of tokens [start, end) whose exact keys are `exact`; None
        when the lookahead tokens after `end` are not in `tokens`."""
        keys = exact
        if self.lookahead:
            after = end + self.lookahead
            if after > len(tokens):
                return None
            ex = extras.for_range(end, after) if extras is not None else b""
            keys = tuple(lookahead_key(k, tokens[end:after], ex) for k in keys)
        if self.lossy_form:
            keys = tuple(lossy_key(k, self.lossy_form) for k in keys)
        return Unit(start, end, keys, links=None if keys is exact else exact)

    def cached_prefix(self, chain: Any, tokens: Sequence[int] | np.ndarray, units: Sequence[Unit], *,
                      count: bool = False, lower: bool = True, extras: ExtraInputs | None = None
                      ) -> list[tuple[Unit, str]]:
        """The longest cached prefix of a prompt's `units` (self.units of
        `tokens`) as (unit, name of the tier holding it), asking `chain` (a
        shmkv.tiers.TierChain) about keys made here: the full chunks, then the
        tail pieces that may extend them (lower tiers only with `lower`)."""
        full = [u for u in units if u.tokens == self.chunk_size]
        found = chain.held_prefix(full, self.roots, count=count, lower=lower)
        if self.piece_size and self.piece_size < self.chunk_size:
            prev = found[-1][0].chain if found else self.chain_roots
            held = chain.first_held(self.piece_candidates(tokens, len(found) * self.chunk_size, prev, extras),
                                    self.roots, lower)
            if held is not None:
                found.append(held)
        return found

    def piece_candidates(self, tokens: Sequence[int] | np.ndarray, start: int, prev: tuple[bytes, ...],
                         extras: ExtraInputs | None = None) -> list[Unit]:
        """Pieces that could extend a hit of full chunks ending at `start`
        (whose last unit's `chain` is `prev`; chain_roots when none), longest first."""
        if not self.piece_size:
            return []
        out = []
        for m in range(self.chunk_size // self.piece_size - 1, 0, -1):
            end = start + m * self.piece_size
            if end + self.lookahead <= len(tokens):
                out.append(self._piece(tokens, start, end, prev, extras))
        return out

    def _piece(self, tokens: Sequence[int] | np.ndarray, start: int, end: int, prev: tuple[bytes, ...],
               extras: ExtraInputs | None) -> Unit:
        ex = extras.for_range(start, end) if extras is not None else b""
        unit = self._unit(start, end, tuple(piece_key(p, tokens[start:end], ex) for p in prev), tokens, extras)
        assert unit is not None, "callers make pieces whose lookahead is in the prompt"
        return unit
