"""KV-cache layout descriptor: one description of a vLLM KV-cache group, built
once from the per-layer tensors: its byte geometry, and the copy backend
(shmkv.transfer.copy_backends, chosen once by the device) that gathers and scatters
over it.

Supported layouts (`kind`), each per layer, any element size (fp32, bf16,
fp16, fp8):

    "cpu"       vLLM 0.32 CPU backend [num_blocks, kv_heads, block_size, 2*head]
                opaque inside a block (K transposed or VNNI-packed by ISA):
                copied as whole blocks; payload [layer][block][block bytes]
    "nhd"       CUDA flash-attention, token-major [num_blocks, block_size, kv_heads, 2*head]
    "hnd"       vLLM 0.32's logical view of every CUDA attention cache,
                [num_blocks, kv_heads, block_size, content] with any physical
                order of the blocks, heads and tokens (vllm/v1/kv_cache_layout.py:
                LBHNC, LBNHC, BLHNC, ...; MLA: one head of the latent): the
                geometry is read from the strides; the content must be contiguous
    "kv_split"  older separate K/V [2, num_blocks, block_size, kv_heads, head]
    "mla"       [num_blocks, block_size, latent_dim]
    "state"     a linear-attention group's recurrent state (vLLM's align mode):
                [num_blocks, ...], each block's state contiguous bytes (vLLM 0.32
                registers it as an int8 view of the page); copied as one run per
                block, a "token" per block: block ids are the slots

The token layouts copy per token into the canonical payload
[layer][token][kv_head][K(head) | V(head)] (MLA: [layer][token][latent]),
which does not depend on the block size.

Layers that are views of one buffer (as vLLM allocates them) cost nothing per
layer at copy time: the C++ core holds the list of layer base addresses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shmkv.errors import InvalidArgumentError
from shmkv.transfer.copy_backends import as_index, backend_for

KINDS = ("cpu", "nhd", "hnd", "kv_split", "mla", "state")


@dataclass(frozen=True)
class LayoutGeometry:
    """Byte geometry of one layer (all layers must share it)."""

    num_blocks: int
    block_size: int
    block_stride: int
    block_bytes: int
    token_mode: bool
    token_stride: int = 0
    runs_i: int = 1
    stride_i: int = 0
    runs_j: int = 1
    stride_j: int = 0
    run_bytes: int = 0
    num_kv_heads: int = 0
    head_size: int = 0


def _geometry(kind: str, t: torch.Tensor) -> LayoutGeometry:
    es = t.element_size()
    s = [x * es for x in t.stride()]
    shape = tuple(t.shape)

    def need(ndim: int, what: str) -> None:
        if t.dim() != ndim:
            raise InvalidArgumentError(f"layout '{kind}' expects a {ndim}-D {what} tensor, got shape {shape}")

    if kind == "cpu":
        need(4, "[num_blocks, kv_heads, block_size, 2*head_size]")
        b, h, n, c = shape
        inner = t[0] if b else t
        if not inner.is_contiguous():
            raise InvalidArgumentError(f"layout 'cpu' needs each block contiguous; strides {t.stride()}")
        return LayoutGeometry(b, n, s[0], h * n * c * es, False, num_kv_heads=h, head_size=c // 2)
    if kind in ("nhd", "hnd"):
        need(4, "[num_blocks, block_size, kv_heads, 2*head_size]" if kind == "nhd"
             else "[num_blocks, kv_heads, block_size, 2*head_size]")
        if kind == "nhd":
            b, n, h, c = shape
            tok, head = s[1], s[2]
        else:
            b, h, n, c = shape
            head, tok = s[1], s[2]
        if t.stride(3) != 1:
            raise InvalidArgumentError(f"layout '{kind}' needs the last dim contiguous; strides {t.stride()}")
        run = c * es
        if head == run:  # all heads of a token are one run
            return LayoutGeometry(b, n, s[0], 0, True, tok, 1, 0, 1, 0, h * run, h, c // 2)
        return LayoutGeometry(b, n, s[0], 0, True, tok, h, head, 1, 0, run, h, c // 2)
    if kind == "kv_split":
        need(5, "[2, num_blocks, block_size, kv_heads, head_size]")
        two, b, n, h, d = shape
        if two != 2 or t.stride(4) != 1:
            raise InvalidArgumentError(
                f"layout 'kv_split' needs shape [2, ...] with a contiguous last dim; got {shape}"
            )
        return LayoutGeometry(b, n, s[1], 0, True, s[2], h, s[3], 2, s[0], d * es, h, d)
    if kind == "mla":
        need(3, "[num_blocks, block_size, latent_dim]")
        b, n, latent = shape
        if t.stride(2) != 1:
            raise InvalidArgumentError(f"layout 'mla' needs the last dim contiguous; strides {t.stride()}")
        return LayoutGeometry(b, n, s[0], 0, True, s[1], 1, 0, 1, 0, latent * es, 1, latent)
    if kind == "state":
        if t.dim() < 2 or not shape[0]:
            raise InvalidArgumentError(f"layout 'state' expects a [num_blocks, ...] tensor, got shape {shape}")
        if not t[0].is_contiguous():
            raise InvalidArgumentError(f"layout 'state' needs each block's state contiguous; strides {t.stride()}")
        nbytes = t[0].numel() * es
        return LayoutGeometry(shape[0], 1, s[0], 0, True, s[0], 1, 0, 1, 0, nbytes, 1, nbytes)
    raise InvalidArgumentError(f"unknown layout kind {kind!r}; expected one of {', '.join(KINDS)}")


class KVLayout:
    """One vLLM KV-cache group: per-layer tensors of one `kind` and shape.

    >>> layout = KVLayout.from_tensors(kv_caches, "cpu")
    >>> layout.gather(block_ids, reservation)   # paged cache -> payload
    >>> layout.scatter(block_ids, lease)        # payload -> paged cache
    """

    def __init__(self, kind: str, layers: Sequence[torch.Tensor], names: Sequence[str] | None = None, *,
                 block_size: int | None = None):
        """`block_size`: tokens per block of vLLM's block tables (the KV-cache
        manager's), when the tensors are viewed in smaller kernel blocks
        (vLLM splits a manager block into dense kernel blocks for some
        backends); token layouts only. Default: the tensors' own."""
        if kind not in KINDS:
            raise InvalidArgumentError(f"unknown layout kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not layers:
            raise InvalidArgumentError("a KV layout needs at least one layer")
        first = layers[0]
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
                raise InvalidArgumentError(
                    f"layer {i} has shape {tuple(t.shape)} {t.dtype} strides {t.stride()}, "
                    f"layer 0 has {tuple(first.shape)} {first.dtype} {first.stride()}"
                )
            if t.device != first.device:
                raise InvalidArgumentError(f"layer {i} is on {t.device}, layer 0 on {first.device}")
        self.kind = kind
        self.names = list(names) if names is not None else [str(i) for i in range(len(layers))]
        self.dtype = first.dtype
        self.device = first.device
        self.geometry = _geometry(kind, first)
        self.layers = list(layers)  # keeps the storage alive
        self._index_of = {n: i for i, n in enumerate(self.names)}
        n = self.geometry.block_size
        self._block_size = block_size or n
        if self._block_size != n and (not self.geometry.token_mode or self._block_size % n):
            raise InvalidArgumentError(
                f"vLLM's blocks of {self._block_size} tokens cannot be copied over {n}-token kernel blocks "
                f"with layout {kind!r}")
        # NOTE: the copy backend is chosen here, once, by the device the cache lives on.
        self.copier = backend_for(self.device, [int(t.data_ptr()) for t in layers], self.geometry)

    @classmethod
    def from_tensors(cls, kv_caches: Mapping[str, torch.Tensor], kind: str) -> KVLayout:
        """From vLLM's register_kv_caches dict (layer name -> tensor), in order."""
        return cls(kind, list(kv_caches.values()), list(kv_caches))

    def layer_index(self, name: str) -> int | None:
        return self._index_of.get(name)

    # ------------------------------------------------------------- sizes --
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def token_mode(self) -> bool:
        return self.geometry.token_mode

    @property
    def block_size(self) -> int:
        """Tokens per block of vLLM's block tables (block ids index these)."""
        return self._block_size

    def bytes_per_token(self) -> int:
        """Payload bytes per token over all layers."""
        g = self.geometry
        if g.token_mode:
            return self.num_layers * g.runs_i * g.runs_j * g.run_bytes
        return self.num_layers * g.block_bytes // g.block_size

    def payload_bytes(self, num_tokens: int) -> int:
        """Payload size of `num_tokens` (a multiple of block_size in block mode)."""
        if not self.token_mode and num_tokens % self.block_size:
            raise InvalidArgumentError(
                f"{num_tokens} tokens is not a whole number of {self.block_size}-token blocks"
            )
        return num_tokens * self.bytes_per_token()

    # ------------------------------------------------------------ copies --
    def gather(self, index: Any, payload: Any, stream: Any = None, *, payload_first: int = 0,
               payload_blocks: int = -1, layers: tuple[int, int] | None = None,
               part: tuple[int, int] | None = None) -> None:
        """Paged cache -> payload. `index`: block ids (block mode) or a slot
        mapping (token mode; negative slots are skipped). In block mode the
        payload may hold `payload_blocks` blocks per layer, of which this
        copy fills those from `payload_first` on. `layers=(begin, end)`
        copies only those layers (the payload keeps all of them). `part` =
        (offset, bytes): this layout's section of a larger payload (one
        KV-cache group of a hybrid model)."""
        self._copy(index, payload, True, stream, payload_first, payload_blocks, layers, part)

    def scatter(self, index: Any, payload: Any, stream: Any = None, *, payload_first: int = 0,
                payload_blocks: int = -1, layers: tuple[int, int] | None = None,
                part: tuple[int, int] | None = None) -> None:
        """Payload -> paged cache (the inverse of gather)."""
        self._copy(index, payload, False, stream, payload_first, payload_blocks, layers, part)

    def _copy(self, index: Any, payload: Any, gather: bool, stream: Any, first: int, blocks: int,
              layers: tuple[int, int] | None, part: tuple[int, int] | None = None) -> None:
        idx = as_index(index, "slot_mapping" if self.token_mode else "block_ids")
        self.copier.copy(idx, payload, gather, stream=stream, first=first, blocks=blocks, layers=layers, part=part)

    @property
    def on_gpu(self) -> bool:
        """Whether copies run on a CUDA device (asynchronous, on a stream)."""
        return self.copier.on_gpu

    def slots_for_blocks(self, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
        """Slot mapping of the first `num_tokens` tokens held in `block_ids`."""
        ids = as_index(block_ids, "block_ids")
        bs = self.block_size
        if num_tokens > len(ids) * bs:
            raise InvalidArgumentError(f"{num_tokens} tokens do not fit in {len(ids)} blocks of {bs}")
        offs = np.arange(num_tokens, dtype=np.int64)
        return ids[offs // bs] * bs + offs % bs
