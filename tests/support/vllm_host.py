"""What the installed vLLM chooses on this host's CPU, asked of vLLM and
never assumed from one machine: vLLM-CPU picks other attention backends on an
Intel Xeon with AMX tiles than on an AMD EPYC (AMX_MLA, which takes any
multiple of 32 tokens per block and 128 by default, against CPU_MLA's 16;
the `amx` ISA of its standard attention against `vec`). The run's header
names them (tests/conftest.py), so a failure says which machine it ran on;
a test parametrizes over `mla_backends()` and takes block sizes from the
engine (EngineProcess.block_size), not from a constant.
"""

from __future__ import annotations

import functools

# the CPU backends an MLA layer can get, each asked for by name (vLLM falls back where one cannot run)
_MLA_CANDIDATES = ("CPU_MLA", "AMX_MLA")


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _backend_name(path: str) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for name in (*_MLA_CANDIDATES, "CPU_ATTN"):
        if AttentionBackendEnum[name].get_path() == path:
            return name
    return path.rsplit(".", 1)[-1]


@functools.cache
def mla_backends() -> tuple[str, ...]:
    """The MLA backends vLLM runs on this host: its own choice first, then
    each other one it accepts when asked for by name."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    cfg = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=None,
                                  use_mla=True)
    chosen: list[str] = []
    for asked in (None, *(AttentionBackendEnum[n] for n in _MLA_CANDIDATES)):
        name = _backend_name(current_platform.get_attn_backend_cls(asked, cfg))
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen)


@functools.cache
def attention_isa(block_size: int = 128, head_size: int = 64) -> str:
    """The ISA vLLM's CPU attention runs a bf16 layer with here (amx, vec, vec16, neon, ...)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, block_size, head_size)


def header() -> str:
    """One line for the run's header: the CPU and vLLM's choices on it."""
    import torch

    try:
        import vllm

        mla = mla_backends()
        choices = (f"vLLM {vllm.__version__}: attention CPU_ATTN isa {attention_isa()} (bf16, 128-token blocks); "
                   f"MLA {mla[0]} (its choice){''.join(', ' + m for m in mla[1:])}")
    except Exception as e:  # noqa: BLE001 - the header never stops a run; the tests that need vLLM say why
        choices = f"vLLM's choices unknown ({type(e).__name__}: {e})"
    return f"host: {cpu_model()}, AMX tiles {'yes' if torch.cpu._is_amx_tile_supported() else 'no'}; {choices}"
