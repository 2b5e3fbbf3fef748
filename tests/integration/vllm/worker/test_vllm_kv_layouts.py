"""The CUDA layouts of the installed vLLM, built on the CPU with vLLM's own
view code (vllm.v1.kv_cache_interface: compute_layout_strides and
create_kv_cache_views, as allocate_kv_cache uses them): every KVCacheLayout
(LBHNC, LBNHC, BLHNC, ...), full attention and MLA, and manager blocks split
into kernel blocks. shmkv reads each geometry from the strides (never from
the rank) and its token gather/scatter, indexed by vLLM's block ids, moves
exactly the bytes the logical view [blocks, heads, tokens, content] holds."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

import torch

from shmkv.errors import InvalidArgumentError
from shmkv.transfer.layout import KVLayout

LAYERS, BLOCKS = 3, 6
# Layouts whose blocks do not hold all their heads together: a block's bytes are
# spread over the head planes, which shmkv's per-block copy geometry cannot express.
REFUSED = {"LHBNC": "reach past the block"}


def _views(spec, layout, kernel_block_size=None, seed=0):
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views

    layer_stride, block_stride, _, _, _ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=g)
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)], layer_stride=layer_stride,
                           block_stride=block_stride)
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel_block_size)


def _token_rows(view: torch.Tensor) -> torch.Tensor:
    """[slots, heads * content bytes] of one layer's logical view (slot = block * tokens + t)."""
    u = view.view(torch.uint8)
    b, h, n, c = u.shape
    return u.permute(0, 2, 1, 3).reshape(b * n, h * c)


def _specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    return {
        "full-attention": FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16),
        "mla": MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=72, dtype=torch.bfloat16),
    }


def _layouts():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(KVCacheLayout)


@pytest.mark.parametrize("layout", _layouts(), ids=lambda x: x.name)
@pytest.mark.parametrize("spec_name", ["full-attention", "mla"])
@pytest.mark.parametrize("kernel_block_size", [None, 16], ids=["manager-blocks", "kernel-blocks-16"])
def test_every_vllm_layout_round_trips_by_vllms_block_ids(layout, spec_name, kernel_block_size):
    spec = _specs()[spec_name]
    try:
        src = _views(spec, layout, kernel_block_size, seed=1)
        dst = _views(spec, layout, kernel_block_size, seed=2)
    except (ValueError, AssertionError) as e:  # vLLM itself refuses this split for this layout
        pytest.skip(f"vLLM does not build {layout.name} with {kernel_block_size}-token kernel blocks: {e}")
    if layout.name in REFUSED and src[0].shape[1] > 1:  # (one head, as MLA has, is one plane)
        with pytest.raises(InvalidArgumentError, match=REFUSED[layout.name]):
            KVLayout("hnd", src, block_size=spec.block_size)
        return
    lay = KVLayout("hnd", src, block_size=spec.block_size)
    out = KVLayout("hnd", dst, block_size=spec.block_size)
    b, h, n, c = src[0].shape
    assert lay.geometry.block_size == n and lay.block_size == spec.block_size
    assert lay.bytes_per_token() == LAYERS * h * c * src[0].element_size()

    block_ids = [4, 1]  # vLLM's (manager) block ids, as the scheduler sends them
    tokens = 2 * spec.block_size - 5  # a partial last block
    slots = torch.as_tensor(lay.slots_for_blocks(block_ids, tokens))
    payload = torch.empty(lay.payload_bytes(tokens), dtype=torch.uint8)
    lay.gather(slots.numpy(), payload)
    want = torch.cat([_token_rows(v)[slots].reshape(-1) for v in src])
    assert torch.equal(payload, want)

    before = [_token_rows(v).clone() for v in dst]
    out.scatter(slots.numpy(), payload)
    for s, d, old in zip(src, dst, before):
        rows, src_rows = _token_rows(d), _token_rows(s)
        assert torch.equal(rows[slots], src_rows[slots])
        others = torch.ones(rows.shape[0], dtype=torch.bool)
        others[slots] = False
        assert torch.equal(rows[others], old[others]), "nothing outside the slots changes"


def test_a_layout_shmkv_cannot_copy_is_refused_with_the_reason():
    t = torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16).transpose(2, 3)  # content not contiguous
    with pytest.raises(InvalidArgumentError, match="last dim contiguous"):
        KVLayout("hnd", [t])
    with pytest.raises(InvalidArgumentError, match="kernel blocks"):
        KVLayout("cpu", [torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)], block_size=32)
