"""The call-order harness (tests/support/vllm_call_order.py) re-enacts
vLLM's model runners by hand; this test reads the installed vLLM's runners
and fails when the order of their connector calls no longer matches the
harness's, so a vLLM release that moves a call cannot leave the harness
proving an order vLLM no longer has.

  V2: GPUModelRunner.execute_model + sample_tokens (vllm/v1/worker/gpu/
      model_runner.py), the last pipeline rank, against Harness.execute_v2.
  V1: KVConnectorModelRunnerMixin._get_kv_connector_output (what
      execute_model's forward runs inside), finalize_kv_connector (the
      speculative-decoding finish) and execute_model's handle_preemptions
      before its request bookkeeping, against Harness.execute_v1.

Each side is read from its source (ast): the calls of the connector's own
methods and of the runner steps around them (the harness names its steps
after vLLM's, through HARNESS_STEPS). The last test feeds the comparison a
patched copy of vLLM's V2 runner (post_forward moved before sampling) and
expects a mismatch: the check can fail."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

import pytest
import vllm_call_order

vllm = pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

CONNECTOR_METHODS = {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")}
CONNECTOR_METHODS |= {"pre_forward", "post_forward", "no_forward"}  # V2's ActiveKVConnector
# vLLM's runner steps around the connector's calls, by the names vLLM 0.32 gives them
V2_STEPS = {"update_requests": "update_requests", "preprocess_state": "preprocess_state",
            "run_fullgraph": "forward", "run_pw_graph": "forward", "model": "forward",
            "sample": "sample", "propose": "propose"}
# the harness's own functions for those steps
HARNESS_STEPS = {"_bookkeeping": "update_requests", "_precopy": "preprocess_state", "_forward": "forward",
                 "_sample": "sample", "_draft": "propose"}


def calls_in_order(func: ast.AST, names: dict[str, str], *, skip: Callable[[ast.If], bool] = lambda n: False,
                   yield_as: str | None = None) -> list[str]:
    """The calls in `func` whose name (`x.name(...)` or `name(...)`) is in
    `names`, as names[name], in source order; a `yield` as `yield_as`; the
    body of an `if` that `skip` selects is left out (its else is kept)."""
    out: list[str] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            self.visit(node.test)
            for stmt in (node.orelse if skip(node) else node.body + node.orelse):
                self.visit(stmt)

        def visit_Call(self, node: ast.Call) -> None:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            self.generic_visit(node)  # the arguments run first
            if name in names:
                out.append(names[name])

        def visit_Yield(self, node: ast.Yield) -> None:
            if yield_as:
                out.append(yield_as)

        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            if node is func:  # the function itself, not the closures defined in it
                self.generic_visit(node)

    Visitor().visit(func)
    return out


def first_seen(seq: list[str]) -> list[str]:
    """Each name once, where it first appears (vLLM's branches repeat a call: FULL graph or not)."""
    return list(dict.fromkeys(seq))


def function(source: str, qualname: str) -> ast.FunctionDef:
    """`Class.method` (or a function) of a module's source."""
    tree = ast.parse(source)
    cls, _, meth = qualname.rpartition(".")
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls) if cls else tree
    return next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == meth)


def harness_method(name: str) -> ast.FunctionDef:
    return function(textwrap.dedent(inspect.getsource(getattr(vllm_call_order.Harness, name))), name)


def not_last_pp_rank(node: ast.If) -> bool:
    return "not self.is_last_pp_rank" in ast.unparse(node.test)


def vllm_v2_order(source: str) -> list[str]:
    names = {**{m: m for m in CONNECTOR_METHODS}, **V2_STEPS}
    execute = calls_in_order(function(source, "GPUModelRunner.execute_model"), names)
    sample = calls_in_order(function(source, "GPUModelRunner.sample_tokens"), names, skip=not_last_pp_rank)
    return first_seen(execute) + first_seen(sample)


def harness_v2_order() -> list[str]:
    return first_seen(calls_in_order(harness_method("execute_v2"), {**{m: m for m in CONNECTOR_METHODS},
                                                                     **HARNESS_STEPS}))


def v2_source() -> str:
    import vllm.v1.worker.gpu.model_runner as v2

    return inspect.getsource(v2)


def test_the_harness_runs_v2s_connector_calls_in_the_installed_vllms_order():
    want = vllm_v2_order(v2_source())
    assert want[:2] == ["update_requests", "no_forward"] and "post_forward" in want, want  # it was read
    assert harness_v2_order() == want


def test_the_harness_runs_v1s_connector_calls_in_the_installed_vllms_order():
    import vllm.v1.worker.gpu_model_runner as v1
    import vllm.v1.worker.kv_connector_model_runner_mixin as mixin

    connector = {m: m for m in CONNECTOR_METHODS}
    mixin_src = inspect.getsource(mixin)
    forward = calls_in_order(function(mixin_src, "KVConnectorModelRunnerMixin._get_kv_connector_output"),
                             connector, yield_as="forward")
    finalize = calls_in_order(function(mixin_src, "KVConnectorModelRunnerMixin.finalize_kv_connector"), connector)
    execute = calls_in_order(function(inspect.getsource(v1), "GPUModelRunner.execute_model"),
                             {**connector, "_update_states": "update_requests"})
    assert forward[0] == "bind_connector_metadata" and "forward" in forward, forward  # it was read

    harness = calls_in_order(harness_method("execute_v1"), {**connector, **HARNESS_STEPS})
    assert first_seen(execute)[:2] == ["handle_preemptions", "update_requests"]
    assert harness[:2] == ["handle_preemptions", "update_requests"]
    # the forward step: from binding the metadata to clearing it
    start = harness.index("bind_connector_metadata")
    end = harness.index("clear_connector_metadata", start) + 1
    assert harness[start:end] == forward
    # speculative decoding: the drafter runs, then finalize_kv_connector
    assert harness[-len(finalize):] == finalize == ["wait_for_save", "clear_connector_metadata"]


def test_a_vllm_that_moves_a_connector_call_fails_the_comparison():
    """A patched copy of vLLM's V2 runner: post_forward asked before sampling."""
    source = v2_source()
    sample = function(source, "GPUModelRunner.sample_tokens")
    lines = source.splitlines()
    call = next(i for i in range(sample.lineno - 1, sample.end_lineno)
                if "sampler_output, num_sampled, num_rejected = self.sample(" in lines[i])
    patched = lines[:call] + ["        self.kv_connector.post_forward(finished_req_ids)"] + lines[call:]
    # the real one still ends with post_forward after sample; the patched one asks it first
    assert vllm_v2_order("\n".join(patched)) != harness_v2_order()
    assert vllm_v2_order(source) == harness_v2_order()
