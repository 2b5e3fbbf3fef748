"""What shmkv reads from vLLM, and nothing else: the engine's namespace (its
model geometry, attention layout and KV-cache groups) and each request's
inputs that change its KV (prompt tokens, multimodal items, prompt
embeddings; its LoRA adapter is adapters.py's). The scheduler half turns
these into keys; the worker half into copy layouts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from shmkv.config import ShmkvConfig
from shmkv.keys import ExtraInputs, MultiModalItem, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("shmkv.connector")


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group of the engine: its layers and sliding window (0:
    full attention), or, for linear-attention layers (Mamba, gated delta
    net) in vLLM's align mode, `state`: the recurrent state's kind, shapes
    and dtypes (one block holds a layer's state after the block's last token)."""

    layer_names: tuple[str, ...]
    window: int = 0
    state: str = ""


def kv_groups_of(kv_cache_config: KVCacheConfig | None, block_size: int) -> tuple[list[KVGroup], str | None]:
    """The engine's KV-cache groups, or the reason shmkv cannot copy them exactly.

    The scheduler and the workers both call this, on vLLM's configs of one
    engine: the scheduler's has each UniformTypeKVCacheSpecs group (layers of
    one attention type but several shapes: a drafter of another head size in
    the target's group, per-layer head counts) replaced by its first layer's
    spec, so such a group must read the same here either way; the workers
    copy it per layer shape (worker.py)."""
    if kv_cache_config is None:
        return [KVGroup(())], None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        specs = _layer_specs(g.kv_cache_spec)
        spec = specs[0]
        kind = type(g.kv_cache_spec).__name__
        # NOTE: an EAGLE/MTP drafter's group (is_eagle_group) is copied like any other: its
        # chunks are keyed with the prefill lookahead tokens it read (drafter_lookahead)
        if not getattr(g, "enable_kv_transfer", True):
            return [], f"KV-cache group {i} is rebuilt by vLLM after a transfer (not transferable state)"
        if type(spec).__name__ == "MambaSpec" or hasattr(spec, "mamba_cache_mode"):
            mode = getattr(spec, "mamba_cache_mode", "?")
            if mode != "align":
                return [], (f"KV-cache group {i} holds linear-attention state ({_state_kind(spec)}, layers "
                            f"{_names(g.layer_names)}; vLLM's mamba_cache_mode={mode}): shmkv restores that "
                            "state only where vLLM keeps it at block boundaries (mamba_cache_mode=align, which "
                            "vLLM picks with prefix caching on), and never loads attention KV without it")
            if getattr(spec, "num_speculative_blocks", 0):
                return [], (f"KV-cache group {i} holds linear-attention state with "
                            f"{spec.num_speculative_blocks} speculative blocks per request (an EAGLE/MTP drafter "
                            "on a Mamba/GDN hybrid: vLLM's num_speculative_blocks, use_eagle_block_drop): shmkv "
                            "restores one state per block boundary, not the drafter's speculative states. Serve "
                            "this model without speculative decoding to use shmkv")
            hash_bs = getattr(kv_cache_config, "hash_block_size", None) or block_size
            if hash_bs < block_size:
                return [], (f"KV-cache group {i} holds linear-attention state and vLLM hashes prefixes in "
                            f"{hash_bs}-token blocks, under the {block_size}-token block (sub-block hits: vLLM "
                            "copies a state block on a partial hit): shmkv restores states at whole blocks only. "
                            "Leave hash_block_size at the block size to use shmkv")
            if spec.block_size != block_size:
                return [], f"KV-cache group {i} ({kind}) has block size {spec.block_size}, not {block_size}"
            groups.append(KVGroup(tuple(g.layer_names), state=_state_desc(spec)))
            continue
        if spec.block_size != block_size:
            return [], f"KV-cache group {i} ({kind}) has block size {spec.block_size}, not {block_size}"
        if all(type(s) in (FullAttentionSpec, MLAAttentionSpec) for s in specs):
            groups.append(KVGroup(tuple(g.layer_names)))
        elif (all(type(s) is SlidingWindowSpec and not s.extra_retained_tokens for s in specs)
              and len({s.sliding_window for s in specs}) == 1):
            groups.append(KVGroup(tuple(g.layer_names), int(spec.sliding_window)))
        else:
            kinds = ", ".join(sorted({type(s).__name__ for s in specs}))
            return [], (f"KV-cache group {i} is {kind} ({kinds}; layers {_names(g.layer_names)}): shmkv copies "
                        "attention KV only, and this state cannot be restored exactly from chunks")
    if groups and all(g.state for g in groups):
        return [], ("the engine's only KV-cache groups hold linear-attention state (no attention KV): shmkv "
                    "restores a state only beside the attention KV of the chunk it ends, and vLLM's per-layer "
                    "load wait covers attention layers only")
    return groups, None


def _layer_specs(spec) -> list:
    """The per-layer specs of a group's spec (a UniformTypeKVCacheSpecs holds one per layer)."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    return list(per_layer.values()) if isinstance(per_layer, dict) and per_layer else [spec]


def _names(layer_names) -> str:
    return ", ".join(layer_names[:3]) + (", ..." if len(layer_names) > 3 else "")


def _state_desc(spec) -> str:
    """What makes two engines' recurrent states (in)compatible: kind, shapes, dtypes."""
    shapes = "x".join(",".join(str(d) for d in shape) for shape in getattr(spec, "shapes", ()))
    dtypes = ",".join(str(t).replace("torch.", "") for t in getattr(spec, "dtypes", ()))
    return f"{_state_kind(spec)}/{shapes}/{dtypes}"


def _state_kind(spec) -> str:
    """The recurrent state's kind as vLLM names it (gated delta net, Mamba2, ...)."""
    kind = getattr(spec, "mamba_type", None)
    return str(getattr(kind, "name", kind) or type(spec).__name__).lower()


# speculative-decoding methods whose drafter has KV layers of its own (copied with the target's)
_KV_DRAFTERS = ("draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark", "extract_hidden_states")


def drafter_field(vllm_config: VllmConfig) -> tuple[tuple[str, str], ...]:
    """Namespace field of an engine whose speculative-decoding drafter has KV
    layers: its payloads hold the drafter's layers beside the target's, so
    they must never meet an engine without that drafter (which shares keys
    with plain engines: ngram and suffix decoding add no KV)."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None or not (sc.method in _KV_DRAFTERS or sc.use_eagle()):
        return ()
    draft = sc.draft_model_config.model if sc.draft_model_config is not None else ""
    return (("drafter", f"{sc.method};{draft};lookahead={drafter_lookahead(vllm_config)}"),)


# Keys of a model's configuration that never change what its layers compute (bookkeeping, generation
# defaults, labels, the path already in model_id): left out of the digest, which holds the rest
CONFIG_KEYS_NOT_IN_KV = frozenset({
    "_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "task_specific_params",
})


def model_config_field(vllm_config: VllmConfig) -> tuple[tuple[str, str], ...]:
    """Namespace field of the model's configuration as the engine computes
    with it: vLLM's resolved hf_config (its hf_overrides, rope settings and
    defaults applied), the quantization method and the overrides as given,
    digested whole (xxh3-128) rather than field by field, less only
    CONFIG_KEYS_NOT_IN_KV. Two engines of one checkpoint directory whose
    configs differ in anything that shapes K and V (rope_theta, YaRN or
    linear rope scaling, partial rotary factor, norm epsilon, activation,
    online quantization, ...) never share keys (#63)."""
    mc = vllm_config.model_config
    overrides = mc.hf_overrides
    doc = {"hf_config": _canonical(mc.hf_config.to_dict()),
           "quantization": mc.quantization,
           "hf_overrides": _callable_name(overrides) if callable(overrides) else _canonical(overrides or {})}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=_canonical_leaf)
    return (("model_config", xxhash.xxh3_128_hexdigest(text.encode())),)


def _canonical(value: Any) -> Any:
    """A config value as plain JSON-able data, CONFIG_KEYS_NOT_IN_KV left out at every depth."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items() if k not in CONFIG_KEYS_NOT_IN_KV}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if hasattr(value, "to_dict") and callable(value.to_dict):  # a nested config object
        return _canonical(value.to_dict())
    return value


def _canonical_leaf(value: Any) -> str:
    """What json cannot write, in words that are the same in every process (never an address)."""
    if callable(value):
        return _callable_name(value)
    return f"{type(value).__module__}.{type(value).__qualname__}:{value}"


def _callable_name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def drafter_lookahead(vllm_config: VllmConfig) -> int:
    """Prompt tokens past a position that the drafter read when it wrote that
    position's KV (vLLM's num_prefill_lookahead_tokens: 1 for EAGLE-family
    drafters, num_speculative_tokens for multi-module MTP, 0 otherwise). The
    drafter's KV of a chunk's last positions depends on them, so a chunk is
    keyed with them too (shmkv.chunking) and one whose lookahead tokens are
    not in the prompt is never stored."""
    return int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)


def chunk_bytes(kv_cache_config: KVCacheConfig | None, chunk_size: int) -> int:
    """One chunk's KV on one TP rank: every layer's pages of `chunk_size`
    tokens (0 when vLLM gave no KV-cache config)."""
    if kv_cache_config is None:
        return 0
    total = 0
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        # NOTE: per-layer specs (UniformTypeKVCacheSpecs) give every layer's pages as one page
        layers = 1 if getattr(spec, "kv_cache_specs", None) else len(g.layer_names)
        total += spec.page_size_bytes * layers * -(-chunk_size // spec.block_size)
    return total


def max_chunk_bytes(kv_cache_config: KVCacheConfig | None, chunk_size: int) -> int | None:
    """An upper bound of one chunk's payload on one TP rank (chunk_bytes,
    twice over for layouts that pad), so that a stored chunk declaring more
    is refused before it is decompressed; None when vLLM gave no KV-cache
    config (then the segment's own bound holds)."""
    total = chunk_bytes(kv_cache_config, chunk_size)
    return 2 * total + (1 << 20) if total else None


def groups_field(groups: list[KVGroup]) -> tuple[tuple[str, str], ...]:
    """Namespace field of a hybrid engine's groups (none for one full-attention group, so
    plain models keep their keys): the payload's sections follow them."""
    if len(groups) == 1 and not groups[0].window and not groups[0].state:
        return ()
    return (("kv_groups", ";".join(f"{g.state or g.window}:{','.join(g.layer_names)}" for g in groups)),)


def namespace_for(vllm_config: VllmConfig, cfg: ShmkvConfig, tp_rank: int,
                  weights: tuple[tuple[str, str], ...] = ()) -> Namespace:
    """Everything that makes KV bytes of this engine incompatible with another's
    (the weights' fields come from weights.py)."""
    from vllm.platforms import current_platform

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = str(mc.dtype).replace("torch.", "")
    cache_dtype = cc.cache_dtype if cc.cache_dtype != "auto" else dtype
    block_size = cc.block_size
    on_cpu = current_platform.is_cpu()
    isa = ""
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(mc.dtype, block_size, mc.get_head_size(),
                            cc.cache_dtype if cc.cache_dtype != "auto" else None)
    # MLA: every TP rank holds the same latent KV (replicated projections of the same hidden
    # state): one chunk set per host, stored by rank 0 (stores_on_rank), loaded by every rank.
    # NOTE: the TP size stays: another size sums its all-reduces in another order, so its
    # KV differs in the last bits
    rank = 0 if mc.use_mla else tp_rank
    return Namespace(
        model_id=str(mc.model),
        dtype=cache_dtype,
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        chunk_size=cfg.chunk_size,
        mla=bool(mc.use_mla),
        tp_size=pc.tensor_parallel_size,
        tp_rank=rank,
        payload="blocks" if on_cpu else "tokens",
        attention_layout="cpu:LBHNC" if on_cpu else ("cuda:mla" if mc.use_mla else "cuda:paged"),
        block_size=block_size,
        isa=isa,
        extra=weights,
    )


def stores_on_rank(vllm_config: VllmConfig, tp_rank: int) -> bool:
    """Whether this TP rank's worker stores: every rank does, but with MLA
    (one latent KV shared by every rank) only rank 0 does."""
    return tp_rank == 0 or not vllm_config.model_config.use_mla


def prompt_tokens(request: Request) -> np.ndarray:
    """The prompt's token ids as vLLM computes with them: positions given as
    embeddings hold 0 (their content is in request_extras)."""
    n = int(request.num_prompt_tokens)
    if request.prompt_token_ids is not None and getattr(request, "prompt_is_token_ids", None) is None:
        return np.asarray(request.prompt_token_ids, dtype=np.int64)
    return np.asarray(request.all_token_ids[:n], dtype=np.int64)


def request_extras(request: Request) -> ExtraInputs | None:
    """The multimodal items and prompt embeddings of a request (None: it has neither)."""
    mm = tuple(MultiModalItem(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
               for f in (getattr(request, "mm_features", None) or ()))
    embeds = getattr(request, "prompt_embeds", None)
    mask = getattr(request, "prompt_is_token_ids", None)
    if not mm and embeds is None:
        return None
    arr = None
    if embeds is not None:
        t = embeds.detach().to("cpu").contiguous()
        arr = t.view(torch.uint8).numpy().reshape(t.shape[0], -1)  # raw bytes per position (bf16 has no numpy dtype)
    return ExtraInputs(mm=mm, embeds=arr, token_mask=None if mask is None else np.asarray(mask, dtype=bool))


def explicit_load_failure_policy(argv: list[str]) -> str | None:
    """The kv_load_failure_policy given on vLLM's command line (`vllm serve
    ... --kv-transfer-config '{"kv_load_failure_policy": "fail", ...}'` or
    `--kv-transfer-config.kv_load_failure_policy fail`), or None when it is
    not there. vLLM 0.32's KVTransferConfig does not record which fields were
    set, and its default ("fail") reads the same as an explicit "fail"; the
    engine processes inherit the server's argv, so this is where a user's
    explicit choice can be seen."""
    import json

    found = None
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("--"):
            continue
        flag = flag[2:].replace("-", "_")
        if not flag.startswith("kv_transfer_config"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag == "kv_transfer_config":
            try:
                obj = json.loads(value)
            except ValueError:
                continue
            if isinstance(obj, dict):
                policy = obj.get("kv_load_failure_policy", obj.get("kv-load-failure-policy"))
                found = policy if isinstance(policy, str) else found
        elif flag == "kv_transfer_config.kv_load_failure_policy":
            found = value
    return found

