"""vLLM 0.32's Python on a lent GPU machine, without vLLM's CUDA wheel.

The lent machines have torch 2.11+cu130 and no network; vLLM's CUDA wheel
pins torch 2.13, so only vLLM's Python files travel (scripts/gpu_v2_bundle.sh).
What a plain bf16 Llama at TP=1 needs of vLLM's compiled parts, given here
(every process vLLM starts imports this file: its directory is first on
PYTHONPATH):
  * `vllm._C_stable_libtorch`, imported unguarded by vllm/platforms/cuda.py:
    an empty module (vLLM then runs its native and Triton paths);
  * the `torch.ops._C` ops layers bind at construction on CUDA
    (vllm/model_executor/layers/activation.py: `self.op = torch.ops._C.x`):
    registered with Python bodies; with custom_ops=["none"] the layers run
    their native forward and never call them;
  * `get_cuda_view_from_cpu_tensor` (Model Runner V2's UVA buffers): a CUDA
    tensor over a pinned host tensor's memory, made through the CUDA array
    interface (with unified addressing a pinned page's host address is its
    device address).
Nothing here is shmkv: a pass on a GPU with this shim is vLLM's Python on a
shimmed runtime, not vLLM's CUDA wheel.
"""

from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")


def _stub_modules() -> None:
    for name in ("vllm._C_stable_libtorch",):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__doc__ = "empty: shmkv's GPU shim (scripts/gpu_v2/shim/sitecustomize.py)"
            sys.modules[name] = mod


# (schema, body): activation ops vLLM's layers bind at construction on CUDA
def _act(fn):
    def body(out, x, *args):
        d = x.shape[-1] // 2
        out.copy_(fn(x[..., :d], x[..., d:], *args))

    return body


def _bodies():
    import torch
    import torch.nn.functional as F

    gelu = lambda a, approx: F.gelu(a, approximate=approx)  # noqa: E731
    return {
        "silu_and_mul(Tensor! out, Tensor input) -> ()": _act(lambda a, b: F.silu(a) * b),
        "mul_and_silu(Tensor! out, Tensor input) -> ()": _act(lambda a, b: a * F.silu(b)),
        "gelu_and_mul(Tensor! out, Tensor input) -> ()": _act(lambda a, b: gelu(a, "none") * b),
        "gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()": _act(lambda a, b: gelu(a, "tanh") * b),
        "fatrelu_and_mul(Tensor! out, Tensor input, float threshold) -> ()":
            _act(lambda a, b, t: torch.where(a > t, a, torch.zeros_like(a)) * b),
        "gelu_new(Tensor! out, Tensor input) -> ()": lambda out, x: out.copy_(gelu(x, "tanh")),
        "gelu_fast(Tensor! out, Tensor input) -> ()": lambda out, x: out.copy_(gelu(x, "tanh")),
        "gelu_quick(Tensor! out, Tensor input) -> ()": lambda out, x: out.copy_(x * torch.sigmoid(1.702 * x)),
        "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor": cuda_view_of_pinned,
    }


_LIBS: list = []  # the torch.library registrations live as long as the process


def _register_ops() -> None:
    import torch

    lib = torch.library.Library("_C", "FRAGMENT")
    _LIBS.append(lib)
    for schema, body in _bodies().items():
        name = schema.split("(", 1)[0]
        if hasattr(torch.ops._C, name):  # a real vLLM build registered it
            continue
        lib.define(schema)
        lib.impl(name, body, "CompositeExplicitAutograd")


class _CudaArray:
    """The CUDA array interface of a pinned host tensor's memory, as bytes."""

    def __init__(self, t) -> None:
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3, "strides": None}


def cuda_view_of_pinned(cpu_tensor):
    """A CUDA tensor over `cpu_tensor`'s pinned memory (no copy): vLLM's
    get_cuda_view_from_cpu_tensor."""
    import torch

    if not cpu_tensor.is_pinned() or not cpu_tensor.is_contiguous():
        raise ValueError("get_cuda_view_from_cpu_tensor: a contiguous pinned host tensor is expected")
    raw = torch.as_tensor(_CudaArray(cpu_tensor), device="cuda")
    return raw.view(cpu_tensor.dtype).view(cpu_tensor.shape)


def install() -> None:
    _stub_modules()
    try:
        _register_ops()
    except ImportError:  # no torch in this interpreter (a tool run by the bundle's script)
        pass


def _chain() -> None:
    """Run the sitecustomize this one shadows (the next on sys.path): the
    environment's own (a distribution's, a virtual environment's) still runs."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in sys.path:
        path = os.path.join(d or ".", "sitecustomize.py")
        if os.path.abspath(d or ".") != here and os.path.isfile(path):
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), {"__name__": "sitecustomize", "__file__": path})
            return


if os.environ.get("SHMKV_GPU_SHIM", "1") == "1":
    install()
_chain()
