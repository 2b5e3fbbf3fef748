"""Weights that change in memory move the engine to a new namespace
generation: a worker's load_weights (vLLM's reload_weights, the weight-
transfer engines, RLHF loaders) marks its board dirty before the weights
move, the scheduler half then neither looks up nor stores until the worker's
next fingerprint, and different weights name a new generation while the
starting weights again name the starting one. A check the scheduler asks for
(after a prefix-cache reset) is answered at the worker's next step."""

from __future__ import annotations

import pytest
import torch

from shmkv.integration.vllm.weights import EngineWeights, FilesIdentity, WorkerWeights, find_models, fingerprint


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(tmp_path / "runtime"))


class Attention(torch.nn.Module):
    pass


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        self.attn = Attention()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)
        return {n for n, _ in weights}


def engine(tmp_path, tp: int = 1) -> tuple[EngineWeights, list[Model], list[WorkerWeights]]:
    models = [Model() for _ in range(tp)]
    workers = [WorkerWeights("engine-1", r, find_models([m.attn])) for r, m in enumerate(models)]
    files = FilesIdentity(str(tmp_path / "no-files"))
    assert files.wait(10)
    return EngineWeights("engine-1", tp, files), models, workers


def test_the_model_is_found_from_its_attention_layer():
    m = Model()
    assert find_models([m.attn]) == [m], "the outermost module with load_weights holding the layer"
    assert find_models([]) == []


def test_a_load_weights_moves_the_engine_to_a_new_generation_and_back(tmp_path):
    ew, models, workers = engine(tmp_path, tp=2)
    assert ew.refresh() is True, "the first boards: the fields are known"
    start = ew.fields()
    assert start is not None and dict(start)["weights"].startswith("path:") and "weights_gen" not in dict(start)
    negated = models[1].norm.detach().clone().neg()
    models[1].load_weights([("norm", negated)])  # rank 1 loads new weights
    ew.refresh()
    assert ew.fields() is None and ew.pending(), "dirty: no lookup, no store until the fingerprint"
    for w in workers:  # the next step: each worker sees its due check
        if w.due(ew.asked):
            w.publish(answered=ew.asked)
    ew.refresh()
    changed = ew.fields()
    assert changed is not None and "weights_gen" in dict(changed) and not ew.pending()
    models[1].load_weights([("norm", negated.neg())])  # the starting weights again
    ew.refresh()
    assert ew.fields() is None
    workers[1].publish()
    ew.refresh()
    assert ew.fields() == start, "the same weights: the starting generation"


def test_a_change_without_the_loader_is_seen_at_the_check_a_reset_asks_for(tmp_path):
    ew, models, workers = engine(tmp_path)
    ew.refresh()
    start = ew.fields()
    with torch.no_grad():
        models[0].q_proj.weight.neg_()  # in place: no load_weights
    ew.refresh()
    assert ew.fields() == start, "unseen until a check"
    ew.ask_check()  # vLLM's reset_prefix_cache
    ew.refresh()
    assert ew.fields() is None and ew.pending()
    assert workers[0].due(ew.asked)
    workers[0].publish(answered=ew.asked)
    ew.refresh()
    assert ew.fields() is not None and ew.fields() != start


def test_the_fingerprint_sees_one_element_and_names_shapes():
    m = Model()
    before = fingerprint(m.named_parameters())
    with torch.no_grad():
        m.q_proj.weight[3, 5] += 1
    assert fingerprint(m.named_parameters()) != before
    assert fingerprint([("a", torch.zeros(4, 2))]) != fingerprint([("a", torch.zeros(2, 4))])


def test_every_step_reads_the_bell_without_a_system_call(tmp_path, monkeypatch):
    """The scheduler refreshes once per step: a board write rings the
    engine's bell (a mapped file), so an unchanged step stats nothing and a
    dirty mark is still seen at the next step."""
    from shmkv.paths import PrivateDir

    ew, models, workers = engine(tmp_path)
    assert ew.refresh() is True
    start = ew.fields()

    def no_stat(*args, **kwargs):
        raise AssertionError("a stat in the per-step refresh")

    monkeypatch.setattr(PrivateDir, "lstat", no_stat)
    monkeypatch.setattr("os.stat", no_stat)
    assert ew.refresh() is False and ew.fields() == start, "nothing changed: nothing read"
    models[0].load_weights([("norm", models[0].norm.detach().clone().neg())])
    ew.refresh()
    assert ew.fields() is None, "the dirty mark heard through the bell"
