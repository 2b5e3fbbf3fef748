"""The model runner's side of the call-order harness
(tests/support/vllm_call_order.py): one engine step as vLLM 0.32's runners
take it (V2: execute_v2, V1: execute_v1), over the device-like stream model,
with the toy model's forward, sampling and drafts. Each step names the vLLM
function it mirrors; the attributes used here are the Harness's."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ReqState:
    tokens: list[int]  # the prompt, then what was sampled
    prompt_len: int
    blocks: list[list[int]] = field(default_factory=list)  # the block table of each KV-cache group
    num_computed: int = 0
    # the tokens the host knows of, those whose sampling is issued but has not run included
    # (asynchronous scheduling: a decode reads the token sampled the step before on the device)
    length: int = -1

    def __post_init__(self) -> None:
        if self.length < 0:
            self.length = len(self.tokens)


@dataclass
class _InputBatch:
    """What ActiveKVConnector reads of V2's InputBatch."""

    req_ids: list[str]
    num_tokens: int
    idx_mapping: Any = None


class RunnerSteps:
    """A runner step and its parts (module doc), mixed into Harness."""

    def _bookkeeping(self, so) -> None:
        """finish/free/add/update requests: the runner's block tables."""
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            # NOTE: V2 sends a resumed request as a new one, its tokens so far as prefill_token_ids
            self.reqs[new.req_id] = ReqState(list(new.prefill_token_ids or new.prompt_token_ids),
                                             len(new.prompt_token_ids), [list(b) for b in new.block_ids],
                                             new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.blocks = [list(b) for b in new_ids] if new_ids else [[] for _ in st.blocks]
                st.tokens = list(cached.all_token_ids.get(req_id, st.tokens))
                st.length = len(st.tokens)
            elif new_ids is not None:
                for table, ids in zip(st.blocks, new_ids):
                    table.extend(ids)
            st.num_computed = cached.num_computed_tokens[i]
            # NOTE: a token vLLM took back (sampled from a failed load) is dropped here, as the runners
            # do; asynchronously scheduled, vLLM has not processed the tokens in flight yet
            if not self.async_scheduling:
                del st.tokens[st.prompt_len + cached.num_output_tokens[i]:]
                st.length = len(st.tokens)

    def _zero_and_copy(self, so) -> None:
        """vLLM zeroes new blocks and runs the copy-on-write copies (compute stream)."""
        tensors = {id(t): (n, t) for n, t in self.caches.items()}.values()  # block ids span the shared pool
        zero = list(so.new_block_ids_to_zero or ())
        if zero:
            for n, t in tensors:
                self.device.compute(f"zero new blocks ({n})", lambda t=t: t.__setitem__(zero, 0),
                                    [(t, zero, "w")])
        for c in so.kv_cache_block_copies or ():
            for n, t in tensors:
                self.device.compute(f"copy-on-write {c.src_block_id}->{c.dst_block_id} ({n})",
                                    lambda t=t, c=c: t[c.dst_block_id].copy_(t[c.src_block_id]),
                                    [(t, [c.src_block_id], "r"), (t, [c.dst_block_id], "w")])

    def _precopy(self, so) -> None:
        """vLLM's align mode before the forward (V1 preprocess_mamba, V2
        preprocess_state): a request whose step crosses a block boundary has
        its running state copied from the block of the last one into the
        block this step's forward reads and writes (compute stream)."""
        if not any(self.model.states):
            return
        for req_id in [*so.finished_req_ids, *(so.preempted_req_ids or ()), *so.scheduled_cached_reqs.resumed_req_ids]:
            self.state_idx.pop(req_id, None)
        bs = self.bs
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            prev = self.state_idx.get(req_id, (st.num_computed - 1) // bs)
            curr = -(-(st.num_computed + n) // bs) - 1
            self.state_idx[req_id] = curr
            if prev == -1 or prev == curr:
                continue
            for li in (li for li, is_state in enumerate(self.model.states) if is_state):
                t = self.caches[self.names[li]]
                table = st.blocks[self.group_of[self.names[li]]]
                src, dst = table[prev], table[curr]
                self.device.compute(f"state pre-copy {src}->{dst} of {req_id} ({self.names[li]})",
                                    lambda t=t, src=src, dst=dst: t[dst].copy_(t[src]),
                                    [(t, [src], "r"), (t, [dst], "w")])

    def _state_forward(self, li: int, plan, sums: dict[str, list[int]]) -> None:
        """A linear-attention layer (no per-layer load hook: vLLM calls
        wait_for_layer_load from attention ops only): from the running
        state's block, through the step's tokens, back into that block."""
        name, bs, m = self.names[li], self.bs, self.model
        t = self.caches[name]
        for req_id, st, lo, hi in plan:
            blk = st.blocks[self.group_of[name]][-(-hi // bs) - 1]
            out = sums[req_id]

            def fn(t=t, blk=blk, lo=lo, hi=hi, st=st, out=out, li=li) -> None:
                s = int((t[blk].float().mean() * 8).round()) if lo else 0  # every byte of the block
                for p, tok in enumerate(st.tokens[lo:hi], start=lo):  # as the device has them
                    s = m.state(li, s, tok, p)
                t[blk] = s / 8  # the whole block: any byte of it loaded wrong is read
                out.append(s)

            self.device.compute(f"forward {name} of {req_id} [{lo}:{hi})", fn, [(t, [blk], "rw")])

    def _uniform_decode(self, so) -> bool:
        return self.full_graphs and bool(so.num_scheduled_tokens) and all(
            n == 1 for n in so.num_scheduled_tokens.values())

    def _plan(self, so) -> list[tuple[str, ReqState, int, int]]:
        """Each scheduled request's positions this step (before sampling moves it on)."""
        plan = []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            lo, hi = st.num_computed, st.num_computed + n
            assert hi <= st.length + 1, (req_id, lo, hi, st.length)
            plan.append((req_id, st, lo, hi))
        return plan

    def _forward(self, plan, layer_waits: bool, layers: range | None = None) -> dict[str, list[int]]:
        """One forward of `layers` (default: the target's): each writes the
        scheduled tokens' KV and reads the whole context's (compute ops on the
        device model); what each request read back, for sampling."""
        sums: dict[str, list[int]] = {req_id: [] for req_id, *_ in plan}
        bs, m = self.bs, self.model
        for li in layers if layers is not None else range(self.layers):
            name = self.names[li]
            if m.states[li]:
                self._state_forward(li, plan, sums)
                continue
            if layer_waits:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                get_kv_transfer_group().wait_for_layer_load(name)  # the attention layer's hook
            t = self.caches[name]
            below_t = self.caches[self.names[li - 1]] if li and not m.states[li - 1] else None
            for req_id, st, lo, hi in plan:
                table = st.blocks[self.group_of[name]]
                # what the queries [lo, hi) read: from the first one's window start (a sliding
                # window's blocks before it may be vLLM's null block or given to others)
                ctx = range(m.window_start(li, lo), hi)
                written = sorted({table[p // bs] for p in range(lo, hi)})
                read = sorted({table[p // bs] for p in ctx} - set(written))
                last = range(m.window_start(li, hi - 1), hi)  # what the last query reads: sampled from
                pos, blk = torch.tensor(last), torch.tensor([table[p // bs] for p in last])
                out = sums[req_id]
                below_ctx = range(m.window_start(li - 1, lo), hi) if below_t is not None else range(0)
                below_table = st.blocks[self.group_of[self.names[li - 1]]] if below_t is not None else []
                below_blk = sorted({below_table[p // bs] for p in below_ctx})

                def fn(t=t, below_t=below_t, li=li, lo=lo, hi=hi, st=st, pos=pos, blk=blk, out=out,
                       table=table, below_ctx=below_ctx, below_table=below_table) -> None:
                    # the tokens as the device has them (a decode's input: the token sampled before)
                    prefix = list(itertools.accumulate(st.tokens[:hi]))[lo:hi]
                    below: dict[int, int] = {}
                    if below_t is not None:  # the layer below, over what a query at p reads of it
                        bpos = torch.tensor(below_ctx)
                        bblk = torch.tensor([below_table[p // bs] for p in below_ctx])
                        vals = (below_t[bblk, 0, bpos % bs, 0].float() * 8).round().long().tolist()
                        run = dict(zip(below_ctx, itertools.accumulate(vals)))  # running sums
                        below = {p: run[p] - run.get(m.window_start(li - 1, p) - 1, 0) for p in range(lo, hi)}
                    for p, ps in zip(range(lo, hi), prefix):
                        t[table[p // bs], :, p % bs, :] = m.kv(li, ps, p, below.get(p, 0)) / 8
                    got = t[blk, 0, pos % bs, 0].float() * 8
                    out.append(int(got.round().long().sum()))

                touches = [(t, read, "r"), (t, written, "rw")]
                if below_t is not None:
                    touches.append((below_t, below_blk, "r"))
                self.device.compute(f"forward {name} of {req_id} [{lo}:{hi})", fn, touches)
        return sums

    def _sample(self, so, sums_by_rank: list[dict[str, list[int]]]) -> Callable[[], Any]:
        """Sampling from the ranks' combined output (a rank that read other KV
        than rank 0 corrupts it: an all-reduce of wrong partial results, so its
        token is not the right one), issued; returns what the host calls to
        read the step's tokens (vLLM's AsyncOutput.get_output). Asynchronously
        scheduled, the sampling runs on the device: the next step's forward,
        issued before the host reads, takes its token from there."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        picks = []  # (request, its state, the position it samples)
        for req_id in req_ids:
            st = self.reqs[req_id]
            st.num_computed += so.num_scheduled_tokens[req_id]
            if st.num_computed < st.length:  # a prefill chunk: nothing sampled
                continue
            picks.append((req_id, st, st.length))
            st.length += 1
        sampled: dict[str, int] = {}

        def sample() -> None:
            for req_id, st, pos in picks:
                assert len(st.tokens) == pos, (req_id, len(st.tokens), pos)
                disagree = sum(s[req_id] != sums_by_rank[0][req_id] for s in sums_by_rank[1:])
                tok = self.model.token(sum(sums_by_rank[0][req_id]) + 7919 * disagree, pos)
                st.tokens.append(tok)
                sampled[req_id] = tok

        if self.async_scheduling:
            self.device.compute("sample", sample)

        def read() -> Any:
            for rk in self.ranks:
                rk.device.sync_compute()  # vLLM reads the sampled tokens on the host
            if not self.async_scheduling:
                sample()
            return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                     sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids])

        return read

    def _draft(self, plan) -> dict[str, list[int]] | None:
        """An EAGLE-style proposer over the same positions: its layers (a FULL
        CUDA graph: no per-layer hook, unless drafter_full_graph is False),
        issued; what they read once the host has synchronized
        (`_take_proposals`)."""
        if not self.drafter_layers or not plan:
            return None
        return self._forward(plan, layer_waits=not self.drafter_full_graph,
                             layers=range(self.layers, self.layers + self.drafter_layers))

    def _take_proposals(self, plan, sums: dict[str, list[int]] | None) -> None:
        """The proposals, read on the host (after it synchronized with the compute)."""
        if sums is None:
            return
        for req_id, st, _lo, hi in plan:
            self.proposals.append((st.tokens[:hi], sum(sums[req_id])))

    def wrong_proposals(self) -> list[tuple[int, int, int]]:
        """(positions, got, want) of each proposal whose drafter KV was not the right one."""
        return [(len(t), got, self.model.draft_checksum(t)) for t, got in self.proposals
                if got != self.model.draft_checksum(t)]

    # ------------------------------------------------------------ runner: V2 --
    def execute_v2(self, so) -> Any:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context

        # vLLM 0.32 gpu/model_runner.py GPUModelRunner.execute_model: update_requests
        self._bookkeeping(so)
        if so.total_num_scheduled_tokens == 0:  # execute_model: kv_connector.no_forward
            outs = []
            for rk in self._each_rank():
                self._zero_and_copy(self._rank_so[rk.tp_rank])
                outs.append(self.kvc.no_forward(self._rank_so[rk.tp_rank]))
            return lambda: self._combined(outs)
        batch = _InputBatch(list(so.num_scheduled_tokens), so.total_num_scheduled_tokens)
        plan = self._plan(so)
        sums_by_rank = []
        for rk in self._each_rank():
            rso = self._rank_so[rk.tp_rank]
            self._zero_and_copy(rso)  # update_requests
            self._precopy(rso)  # execute_model: model_state.preprocess_state, before pre_forward
            if self._uniform_decode(rso):  # the FULL CUDA-graph branch: no forward context, no per-layer hook
                self.kvc.pre_forward(rso, batch, attn_metadata={"full": True})
                sums = self._forward(plan, layer_waits=False)
            else:
                with set_forward_context({}, self.vllm_config, num_tokens=so.total_num_scheduled_tokens,
                                         cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE):
                    self.kvc.pre_forward(rso, batch)
                    sums = self._forward(plan, layer_waits=True)
            self.kvc.finish_forward()  # execute_model: kv_connector.finish_forward after the model's run
            sums_by_rank.append(sums)
        # sample_tokens (vLLM 0.32 gpu/model_runner.py): sampling and the speculator's proposal are
        # issued, post_forward asks the connector, and only then does the host read the sampled tokens
        # (AsyncOutput.get_output, from the engine core): no host sync before the connector answers
        read = self._sample(so, sums_by_rank)
        kv_outs, drafts = [], []
        for rk in self._each_rank():
            drafts.append(self._draft(plan))
            kv_outs.append(self.kvc.post_forward(self._rank_so[rk.tp_rank].finished_req_ids))

        def output() -> Any:
            out = read()
            for _rk, sums in zip(self._each_rank(), drafts):
                self._take_proposals(plan, sums)
            return self._combined([self._rank_output(out, kv_out) for kv_out in kv_outs])

        return output

    # ------------------------------------------------------------ runner: V1 --
    def execute_v1(self, so) -> Any:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, set_forward_context
        from vllm.v1.outputs import KVConnectorOutput

        # vLLM 0.32 gpu_model_runner.py GPUModelRunner.execute_model: handle_preemptions, _update_states
        for rk in self._each_rank():
            self.worker.handle_preemptions(self._rank_so[rk.tp_rank].kv_connector_metadata)
        self._bookkeeping(so)
        full = self._uniform_decode(so)
        mode = CUDAGraphMode.FULL if full else CUDAGraphMode.PIECEWISE
        plan = self._plan(so)
        defer = bool(self.drafter_layers)  # with a drafter, wait_for_save comes after its forward
        sums_by_rank, kv_outs = [], []
        for rk in self._each_rank():
            conn, rso = self.worker, self._rank_so[rk.tp_rank]
            self._zero_and_copy(rso)
            if so.total_num_scheduled_tokens:
                self._precopy(rso)  # preprocess_mamba, before the forward context (bind, loads)
            kv_out = KVConnectorOutput()
            sums: dict[str, list[int]] = {}
            ctx = set_forward_context({}, self.vllm_config, num_tokens=so.total_num_scheduled_tokens,
                                      cudagraph_runtime_mode=mode) if so.total_num_scheduled_tokens else \
                set_forward_context(None, self.vllm_config)
            with ctx:  # kv_connector_model_runner_mixin.py _get_kv_connector_output, around the forward
                conn.bind_connector_metadata(rso.kv_connector_metadata)
                if so.has_sync_kv_loads:
                    conn.start_load_kv(get_forward_context())
                try:
                    if so.total_num_scheduled_tokens:
                        sums = self._forward(plan, layer_waits=not full)
                finally:
                    if not so.has_sync_kv_loads:
                        conn.start_load_kv(get_forward_context())
                    if not defer:
                        conn.wait_for_save()
                    res = conn.get_transfer_results(so.finished_req_ids)
                    kv_out.finished_sending = res.finished_sending or None
                    kv_out.finished_recving = res.finished_recving or None
                    kv_out.failed_recving = res.failed_recving
                    kv_out.invalid_block_ids = conn.get_block_ids_with_load_errors()
                    kv_out.kv_connector_stats = conn.get_kv_connector_stats()
                    kv_out.kv_cache_events = conn.get_kv_connector_kv_cache_events()
                    kv_out.kv_connector_worker_meta = conn.build_connector_worker_meta()
                    if not defer:
                        conn.clear_connector_metadata()
            sums_by_rank.append(sums)
            kv_outs.append(kv_out)
        read = self._sample(so, sums_by_rank) if so.total_num_scheduled_tokens else None
        if defer:  # V1's spec decoding (sample_tokens): sample, propose, then finalize_kv_connector
            mode = CUDAGraphMode.FULL if self.drafter_full_graph else CUDAGraphMode.PIECEWISE
            for _ in self._each_rank():
                with set_forward_context({}, self.vllm_config, cudagraph_runtime_mode=mode):
                    sums = self._draft(plan)
                self.device.sync_compute()  # V1's proposer hands its drafts to the host
                self._take_proposals(plan, sums)
                self.worker.wait_for_save()
                self.worker.clear_connector_metadata()

        def output() -> Any:
            out = read() if read is not None else None
            return self._combined([self._rank_output(out, kv_out) for kv_out in kv_outs])

        return output
