"""How the worker half reads vLLM's KV caches (worker.py's
register_kv_caches): one KVLayout per KV-cache group, or per layer shape
where a group's layers differ (a drafter of another head size, per-layer
head counts), over the group's block ids; a linear-attention group (align
mode) as the state of each block.

vLLM 0.32 views every layer's cache as [blocks, heads, block tokens, content]
(vllm/v1/kv_cache_interface.py create_kv_cache_views), in the physical order
of the engine's KVCacheLayout: the strides say which. On the CPU backend the
content of a block is ISA-packed: whole blocks are copied.

Invariant: a tensor of any other rank is refused (InvalidArgumentError,
naming its shape): the worker then serves without shmkv, saying why."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from shmkv.errors import InvalidArgumentError
from shmkv.transfer.layout import KVLayout

log = logging.getLogger("shmkv.connector")


def _layers_by_shape(names: Sequence[str], kv_caches: dict[str, Any]) -> list[tuple[str, ...]]:
    """A group's layers by tensor shape, dtype and strides, in the order each first appears."""
    out: dict[tuple, list[str]] = {}
    for n in names:
        t = kv_caches[n]
        out.setdefault((tuple(t.shape[1:]), t.dtype, tuple(t.stride())), []).append(n)
    return [tuple(v) for v in out.values()]


def _shape_desc(t: Any, layers: int) -> str:
    """One section of a payload: its layers' shape past the block dim, dtype, and how many layers."""
    return f"{'x'.join(str(d) for d in t.shape[1:])}/{str(t.dtype).replace('torch.', '')}/{layers}"


def first_attention_tensor(kv_caches: dict[str, Any], groups: Sequence[Any]) -> Any:
    """The first attention layer's tensor (a state group's may come first, and may be a list)."""
    attn_names = [n for g in groups if not g.state for n in g.layer_names]
    first = kv_caches.get(attn_names[0]) if attn_names else None
    return first if first is not None else next(iter(kv_caches.values()))


def layouts_of(kv_caches: dict[str, Any], groups: Sequence[Any],
               block_size: int) -> tuple[list[KVLayout], list[int], str]:
    """(the layouts, each one's KV-cache group, the sections of the groups
    whose layers differ in shape: "group:shape/dtype/layers;..." joined by |)."""
    first = first_attention_tensor(kv_caches, groups)
    if first.dim() != 4:
        raise InvalidArgumentError(f"a {first.dim()}-D KV cache tensor of shape {tuple(first.shape)} "
                                   "(vLLM 0.32 gives [blocks, heads, block tokens, content])")
    kind = "cpu" if first.device.type == "cpu" else "hnd"
    layouts, layout_groups, sections = [], [], []
    for gi, (g, names) in enumerate(zip(groups, [g.layer_names or tuple(kv_caches) for g in groups])):
        by_shape = _layers_by_shape(names, kv_caches)
        for shape_names in by_shape:
            tensors = [kv_caches[n] for n in shape_names]
            layouts.append(KVLayout("state", tensors, shape_names) if g.state
                           else KVLayout(kind, tensors, shape_names, block_size=block_size))
            layout_groups.append(gi)
        if len(by_shape) > 1:
            sections.append(f"{gi}:" + ";".join(_shape_desc(kv_caches[n[0]], len(n)) for n in by_shape))
    return layouts, layout_groups, "|".join(sections)


def say_registered(layouts: Sequence[KVLayout], layers: int, groups: int, kind: str, on_gpu: bool,
                   sections: str) -> None:
    """The log lines of a registration: layers, layout, bytes per token, copies, state groups, sections."""
    attention = [lay for lay in layouts if lay.kind != "state"]
    log.info("shmkv: registered %d KV layers in %d group(s) (%s layout, %s, %.1f KiB per token, %s copies)",
             layers, groups, kind, str(attention[0].dtype).replace("torch.", ""),
             sum(lay.bytes_per_token() for lay in attention) / 1024,
             "CUDA stream" if on_gpu else "asynchronous CPU")
    for lay in layouts:
        if lay.kind == "state":
            log.info("shmkv: %d linear-attention layers keep %.1f KiB of recurrent state per block boundary",
                     lay.num_layers, lay.geometry.run_bytes / 1024)
    if sections:
        log.info("shmkv: layers of one KV-cache group differ in shape; copied per shape (sections %s)", sections)
