"""A test run beside a neighbour (tests/test_neighbour_files_kept.py): run
as `python neighbour_run.py WORKDIR MODEL_DIR` in a mount namespace with a
/dev/shm of its own, it starts

  * a neighbour process outside the run (a session of its own), which makes
    what vLLM's processes make while they start (a named semaphore of
    multiprocessing's spawn context, a message queue in /dev/shm) when told,
    and later starts a worker that opens both by name, as vLLM's workers do;
    and what a neighbour's engine harness and shmkv make meanwhile (a child
    whose TMPDIR is a new directory in the run's temporary directory, a
    segment it maps, that cache's registry file and a weights board it maps
    in the runtime directory);
  * a nested pytest session with the suite's leftovers plugin, whose one test
    starts a vLLM engine through the harness, kills it, and then, in the
    run's last moments, has the neighbour make its files;

then, once the run ended, has the neighbour start its worker, and prints one
JSON line: the run's exit code and output tail, the worker's answer, and
/dev/shm before and after. Synchronised by pipes the run inherits, not by
time (a run that fails first closes them: the driver reads EOF).

`python neighbour_run.py --neighbour` is the neighbour itself.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
from multiprocessing import shared_memory

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

INNER_TEST = '''
import os
import random

from shmkv.engines.engine import EngineProcess, EngineSpec


def test_a_killed_engine_leaves_nothing_while_a_neighbour_starts(tmp_path):
    # vLLM's own process split (EngineCore and a worker): message queues and semaphores in /dev/shm
    # (EngineCore in the engine's process with one rank makes none: its worker runs in that process)
    spec = EngineSpec(os.environ["MODEL_DIR"], shmkv=None, in_process=False)
    e = EngineProcess(spec, str(tmp_path / "engine.log"))
    prompt = [random.Random(0).randrange(3, 500) for _ in range(64)]
    assert len(e.generate([prompt], max_tokens=2)["outputs"][0]) == 2
    e.owned_files.sample()
    held = dict(e.owned_files.shm)
    e.kill()  # no teardown, as `vllm serve` ends by default
    assert held, "the engine's processes held vLLM's files in /dev/shm"
    assert not [n for n in held if os.path.exists("/dev/shm/" + n)], "removed by ownership"
    # the run's last moments: the neighbour makes its files now
    os.write(int(os.environ["NEAR_END_FD"]), b"near the end")
    assert os.read(int(os.environ["MADE_FD"]), 16) == b"made"
'''


def _worker(lock, psm_name: str, conn) -> None:  # noqa: ANN001 - multiprocessing's objects
    with lock:
        shm = shared_memory.SharedMemory(name=psm_name)
        conn.send(int(shm.buf[0]))
        shm.close()


def neighbour() -> None:
    """The neighbour: reads commands on stdin, answers one JSON line each."""
    import mmap

    from shmkv import Store

    ctx = mp.get_context("spawn")
    lock = shm = store = engine_child = board = None
    made: list[str] = []
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "make":  # make TMP RUNTIME_DIR
            tmp, runtime = args
            lock = ctx.Lock()
            shm = shared_memory.SharedMemory(create=True, size=64)
            shm.buf[0] = 42
            answer = {"sem": "sem." + lock._semlock.name.lstrip("/"), "psm": shm.name}
            engine_tmp = tempfile.mkdtemp(prefix="shmkv-engine-tmp-", dir=tmp)  # an engine's, as the harness's
            engine_child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                            stdin=subprocess.PIPE, env={**os.environ, "TMPDIR": engine_tmp})
            cache = f"shmkv-neighbour-{os.getpid()}"
            store = Store.create(cache, 8 << 20, populate=False, segment_dir="")
            registry = os.path.join(runtime, cache + ".engines.jsonl")
            with open(registry, "w") as f:
                f.write("{}\n")
            board_path = os.path.join(runtime, "weights-board.neighbour.0")
            with open(board_path, "wb") as f:
                f.write(b"\0" * 4096)
            with open(board_path, "r+b") as f:
                board = mmap.mmap(f.fileno(), 4096)
            made = [engine_tmp, registry, board_path]
            answer.update(segment=cache, engine_tmp=os.path.basename(engine_tmp),
                          runtime_files=sorted(os.path.basename(p) for p in made[1:]))
        elif cmd == "worker":
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(lock, shm.name, child))
            p.start()
            child.close()
            try:
                answer = {"worker_read": parent.recv()}
            except EOFError:
                answer = {"worker_read": None}
            p.join()
            answer["worker_exit"] = p.exitcode
        else:  # quit
            if shm is not None:
                shm.close()
                shm.unlink()
            if engine_child is not None:
                engine_child.stdin.close()
                engine_child.wait(timeout=60)
            if board is not None:
                board.close()
            if store is not None:
                store.close()
                Store.unlink(store.name, segment_dir="")
            if made:
                shutil.rmtree(made[0], ignore_errors=True)
                for p in made[1:]:
                    os.unlink(p)
            print(json.dumps({"bye": True}), flush=True)
            return
        print(json.dumps(answer), flush=True)


def main(workdir: str, model_dir: str) -> None:
    tmp = tempfile.mkdtemp(prefix="shmkv-nb-", dir="/tmp")  # short: vLLM's IPC socket paths are under it
    runtime = os.path.join(workdir, "runtime")
    os.makedirs(runtime, mode=0o700)
    near_end_r, near_end_w = os.pipe()
    made_r, made_w = os.pipe()
    test = os.path.join(workdir, "test_inner.py")
    with open(test, "w") as f:
        f.write(INNER_TEST)
    before = sorted(os.listdir("/dev/shm"))
    nb = subprocess.Popen([sys.executable, __file__, "--neighbour"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, start_new_session=True)

    def ask(cmd: str) -> dict:
        nb.stdin.write(cmd + "\n")
        nb.stdin.flush()
        return json.loads(nb.stdout.readline())

    env = {**os.environ, "TMPDIR": tmp, "SHMKV_RUNTIME_DIR": runtime, "MODEL_DIR": model_dir,
           "NEAR_END_FD": str(near_end_w), "MADE_FD": str(made_r),
           "PYTHONPATH": os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ENGINE_START_LOG", None)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "leftovers", "-p", "no:cacheprovider",
                            "-p", "no:xdist", "-q", "--rootdir", workdir, test],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir,
                           pass_fds=(near_end_w, made_r))
    os.close(near_end_w)
    os.close(made_r)
    # the run's test in its last moments, or the run ended first (EOF)
    reached = os.read(near_end_r, 64) == b"near the end"
    files = ask(f"make {tmp} {runtime}") if reached else {}
    if reached:
        os.write(made_w, b"made")
    os.close(made_w)
    out, _ = run.communicate(timeout=600)
    os.close(near_end_r)
    left_in_tmp = sorted(os.listdir(tmp))
    runtime_after_run = sorted(os.listdir(runtime))
    after_run = sorted(os.listdir("/dev/shm"))
    worker = ask("worker") if reached else {}
    ask("quit")
    shutil.rmtree(tmp, ignore_errors=True)
    nb.wait(timeout=60)
    print(json.dumps({"run_exit": run.returncode, "run_tail": out[-3000:], "neighbour_files": files,
                      "left_in_tmp": left_in_tmp, "runtime_after_run": runtime_after_run,
                      "worker": worker, "shm_before": before, "shm_after_run": after_run,
                      "shm_at_end": sorted(os.listdir("/dev/shm"))}))


if __name__ == "__main__":
    if sys.argv[1] == "--neighbour":
        neighbour()
    else:
        main(sys.argv[1], sys.argv[2])
