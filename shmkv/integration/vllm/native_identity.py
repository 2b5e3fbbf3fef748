"""The native tier's identity of the KV (native_tier.py): what the connector's
keys name (weights.py, engine_inputs.model_config_field), for an engine that
runs vLLM's OffloadingConnector with `{"type": "shmkv"}` in its
secondary_tiers, where shmkv's code runs in no worker step.

  * The configuration: vLLM builds the tier from an OffloadingConfig, which
    holds the model's name and KV dtype only. shmkv's plugin wraps vLLM's
    build_offloading_config so the OffloadingConfig carries the VllmConfig
    it came from (VLLM_CONFIG_ATTR); the tier's namespace then names the
    resolved model configuration (its overrides, rope settings,
    quantization), as the connector's does.
  * The weights as loaded: each worker digests its tensors as the loader
    produced them (loaded_weights.py) and, right after vLLM's post-load
    step, starts a weights watch (watch_loaded) that writes the rank's board
    in the runtime directory: that digest and a fingerprint of what the
    model holds. The workers load before vLLM builds the scheduler, so the
    tier reads every rank's board when it starts; where a rank has no
    digest as loaded, the weight files' digest (hub models: the commit vLLM
    resolved) names them.
  * The weights in memory: every call from the engine to a worker not known
    to leave the weights alone marks the board dirty before it runs and
    fingerprints the weights again once it returned (loaded_weights'
    worker-call hook; there is no connector step in the worker to do it
    later). While a board is dirty the tier answers MISS and stores nothing;
    weights that differ from the start name a new generation (a new
    namespace root), the same weights again the starting one. vLLM's
    TieringOffloadingManager keeps secondary tiers on a weight update by
    design: the keys are what keeps the old weights' KV out.

Where the VllmConfig is not known (vLLM's manager driven without an engine,
as in shmkv's own native-tier benchmark), the namespace names the weight
files of the model named in the OffloadingConfig, as before, and says so.

Invariant: the tier loads and stores only while its weights are known, and
only under a root that names them.
"""

from __future__ import annotations

import logging
from typing import Any

from shmkv.integration.vllm.loaded_weights import loaded_digest
from shmkv.integration.vllm.weights import EngineWeights, WorkerWeights, board_id, engine_weights, tp_rank
from shmkv.integration.vllm.weights_boards import board_stamp, read_board, remove_boards
from shmkv.integration.vllm.weights_files import files_identity

log = logging.getLogger("shmkv.native_tier")

VLLM_CONFIG_ATTR = "_shmkv_vllm_config"
_HOOKED = "_shmkv_offloading_config_hook"
_watches: dict[tuple[str, int], WorkerWeights] = {}  # (board id, rank) -> this worker's weights watch


def install_config_hook(module: Any) -> bool:
    """Wrap build_offloading_config where vLLM's OffloadingConnector calls it
    (idempotent): the OffloadingConfig carries its VllmConfig."""
    original = getattr(module, "build_offloading_config", None)
    if original is None:
        log.debug("shmkv: vLLM's offloading connector has no build_offloading_config to hook")
        return False
    if getattr(original, _HOOKED, False):
        return True

    def build_offloading_config(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(vllm_config, *args, **kwargs)
        try:
            object.__setattr__(config, VLLM_CONFIG_ATTR, vllm_config)  # a frozen dataclass
        except Exception as e:  # noqa: BLE001 - the tier then names the files alone (module doc)
            log.debug("shmkv: cannot attach the VllmConfig to the OffloadingConfig: %s", e)
        return config

    setattr(build_offloading_config, _HOOKED, True)
    build_offloading_config.__wrapped__ = original  # type: ignore[attr-defined]
    module.build_offloading_config = build_offloading_config
    return True


def watch_loaded(model: Any, vllm_config: Any) -> None:
    """A worker, right after vLLM's post-load step: start (or extend, for a
    drafter) this rank's weights watch and write its board. Never raises."""
    try:
        key = (board_id(vllm_config), tp_rank())
        w = _watches.get(key)
        if w is None:
            w = _watches[key] = WorkerWeights(*key, [], settle_after_calls=True)
        w.add_model(model, loaded_digest(w.models + [model]))
    except Exception as e:  # noqa: BLE001 - no board: the tier names the weight files (NativeIdentity)
        log.warning("shmkv: the native tier's weights watch could not start (%s: %s): the tier names the weight "
                    "files, and does not see weights changed in memory", type(e).__name__, e)


class NativeIdentity:
    """The tier's view of what its keys must name (module doc)."""

    def __init__(self, offloading_config: Any) -> None:
        self.vllm_config = getattr(offloading_config, VLLM_CONFIG_ATTR, None)
        self.model = str(offloading_config.model.name)
        self.weights: EngineWeights | None = None
        self._files: tuple[tuple[str, str], ...] | None = None
        if self.vllm_config is None:
            log.warning("shmkv: the native tier does not know its engine's configuration (no VllmConfig with the "
                        "OffloadingConfig): its keys name the model's weight files and KV geometry only, not "
                        "config overrides nor weights changed in memory")
            return
        from shmkv.integration.vllm.engine_inputs import model_config_field

        self.config_fields = model_config_field(self.vllm_config)
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        boards = [read_board(board_id(self.vllm_config), r) for r in range(tp)]
        if any(b is None for b in boards):
            mc = self.vllm_config.model_config
            commit = getattr(getattr(mc, "hf_config", None), "_commit_hash", None)
            log.warning("shmkv: no weights board from TP rank(s) %s (their weights watch did not start): the native "
                        "tier's keys name the weight files, and weights changed in memory are not seen",
                        [r for r, b in enumerate(boards) if b is None])
            self._files = self.config_fields + (
                ("weights", _files_or_private(str(mc.model), commit if isinstance(commit, str) else None)),)
            return
        self.weights = engine_weights(self.vllm_config)
        self.weights.set_tensors({r: (str(b["loaded"]), str(b.get("basis", "held")))
                                  for r, b in enumerate(boards) if b and b.get("loaded")})
        self._stamps: tuple | None = None
        self._fields: tuple[tuple[str, str], ...] | None = None

    def fields(self) -> tuple[tuple[str, str], ...] | None:
        """The identity's namespace fields now; None while the weights are
        not known (a rank's board dirty, a fingerprint failed, files unread)."""
        if self.weights is None:
            if self._files is None:
                self._files = (("weights", _files_or_private(self.model)),)
            return self._files
        # NOTE: every lookup asks: the boards are read again only when a rank's bell rang
        stamps = tuple(board_stamp(self.weights.engine_id, r) for r in range(self.weights.tp_size))
        if stamps != self._stamps or self._fields is None:
            self._stamps = stamps
            self.weights.refresh()
            weights = self.weights.fields()
            self._fields = None if weights is None else self.config_fields + weights
        return self._fields

    def close(self) -> None:
        if self.weights is not None:
            remove_boards(self.weights.engine_id, self.weights.tp_size)


def _files_or_private(model: str, commit: str | None = None) -> str:
    import os
    import time

    try:
        return files_identity(model, commit)
    except OSError as e:  # provenance unknown: a namespace of this process alone (right or unused)
        log.warning("shmkv: cannot read the weight files of %s (%s): this engine shares no chunks", model, e)
        return f"unreadable:{os.getpid()}:{time.time_ns()}"
