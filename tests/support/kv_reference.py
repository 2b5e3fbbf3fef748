"""Plain-PyTorch reference of the paged gather/scatter, and KV caches built the
way vLLM allocates them (all layers views of one flat buffer)."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def shape_of(kind: str, blocks: int, bs: int, heads: int, head: int) -> tuple[int, ...]:
    return {
        "cpu": (blocks, heads, bs, 2 * head),
        "nhd": (blocks, bs, heads, 2 * head),
        "hnd": (blocks, heads, bs, 2 * head),
        "kv_split": (2, blocks, bs, heads, head),
        "mla": (blocks, bs, 2 * head),
        # a recurrent state per block (vLLM's int8 view of a page): one "token" per block
        "state": (blocks * bs, 1, 1, heads * 2 * head),
    }[kind]


def make_cache(kind: str, layers: int, blocks: int, bs: int, heads: int, head: int,
               dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> list[torch.Tensor]:
    shape = shape_of(kind, blocks, bs, heads, head)
    numel = 1
    for d in shape:
        numel *= d
    es = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 256, (layers * numel * es,), dtype=torch.uint8, generator=g)
    # fp8 has NaN encodings; keep bytes as bytes, never compute on them
    flat = flat.to(device)
    return [flat[i * numel * es:(i + 1) * numel * es].view(dtype).view(shape) for i in range(layers)]


def _tokens_u8(kind: str, t: torch.Tensor) -> torch.Tensor:
    """[num_slots, token payload bytes] view of one layer, canonical order."""
    u = t.view(torch.uint8)
    if kind == "nhd":
        b, n, h, c = u.shape
        return u.reshape(b * n, h * c)
    if kind == "hnd":
        b, h, n, c = u.shape
        return u.permute(0, 2, 1, 3).reshape(b * n, h * c)
    if kind == "kv_split":
        two, b, n, h, d = u.shape
        return u.permute(1, 2, 3, 0, 4).reshape(b * n, h * 2 * d)
    if kind == "mla":
        b, n, c = u.shape
        return u.reshape(b * n, c)
    if kind == "state":
        return u.reshape(u.shape[0], -1)
    raise ValueError(kind)


def ref_gather(kind: str, layers: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    out = []
    for t in layers:
        if kind == "cpu":
            out.append(t.view(torch.uint8)[index].reshape(-1))
        else:
            tok = _tokens_u8(kind, t)
            rows = torch.zeros((len(index), tok.shape[1]), dtype=torch.uint8, device=tok.device)
            ok = index >= 0
            rows[ok] = tok[index[ok]]
            out.append(rows.reshape(-1))
    return torch.cat(out)


def ref_scatter(kind: str, layers: list[torch.Tensor], index: torch.Tensor, payload: torch.Tensor) -> None:
    per_layer = payload.numel() // len(layers)
    for li, t in enumerate(layers):
        part = payload[li * per_layer:(li + 1) * per_layer]
        if kind == "cpu":
            u = t.view(torch.uint8)
            u[index] = part.view(len(index), *u.shape[1:])
        else:
            u = t.view(torch.uint8)
            rows = part.view(len(index), -1)
            ok = index >= 0
            if kind == "nhd":
                b, n, h, c = u.shape
                u.view(b * n, h * c)[index[ok]] = rows[ok]
            elif kind == "hnd":
                b, h, n, c = u.shape
                v = u.permute(0, 2, 1, 3)  # [b, n, h, c] view
                flat_idx = index[ok]
                v[flat_idx // n, flat_idx % n] = rows[ok].view(-1, h, c)
            elif kind == "kv_split":
                two, b, n, h, d = u.shape
                v = u.permute(1, 2, 3, 0, 4)  # [b, n, h, 2, d]
                flat_idx = index[ok]
                v[flat_idx // n, flat_idx % n] = rows[ok].view(-1, h, 2, d)
            elif kind == "mla":
                b, n, c = u.shape
                u.view(b * n, c)[index[ok]] = rows[ok]
            elif kind == "state":
                u.view(u.shape[0], -1)[index[ok]] = rows[ok]
