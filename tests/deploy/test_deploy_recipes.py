"""The deployment recipes run here (their manifests are checked in
tests/deploy/test_deploy_manifests.py): the Compose recipe's daemon and two
vLLM engines, each a container (`unshare`: PID and mount namespaces, a
private /dev/shm, the daemon's root read-only) with the recipe's volumes at
the recipe's paths and the recipe's environment, the daemon's command and
health check as written; engine 2 loads what engine 1 stored. The same for
the pod-local variant (its sidecar) and the root variant (its node
preparation and daemon). The harness runs as the test's uid (the recipe's
uid 1000 has no Python here) and shrinks the capacity to 256 MiB
(SHMKV_CAPACITY, which a variable may set over the file)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from typing import Any

import pytest
import yaml
from deploy_recipes import (
    DEPLOY,
    ROOT_ONLY,
    compose,
    env_of,
    kv_transfer_config,
    pod_local_docs,
    variant_docs,
)
from helpers import E2E_TOKENS, REPO, check_loaded_bytes_equal_stored, random_prompt

from shmkv import Store
from shmkv.engines.engine import container_argv, signal_container

# ------------------------------------------------- the recipe, running ---
ROOT = ROOT_ONLY


@pytest.fixture
def host(tmp_path):
    """The host side of the Compose recipe: a tmpfs for the segments and a
    state directory (in tmp_path: what host/ makes at /run/shmkv and
    /var/lib/shmkv), the config directory, and each container path that
    does not exist here made as an empty mount point (removed after).
    Yields {container path: host path}."""
    segments, state = tmp_path / "run-shmkv", tmp_path / "var-lib-shmkv"
    segments.mkdir(mode=0o700)
    state.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "shmkv-segments", str(segments)],
                   check=True)
    binds: dict[str, str] = {}
    for volume in compose()["x-shmkv-container"]["volumes"]:
        source, inside = volume.split(":")[:2]
        binds[inside] = {"/run/shmkv": str(segments), "/var/lib/shmkv": str(state)}[source]
    # the inline config, as Compose writes it into a container: its text, owned by root, mode 0444
    for given in compose()["x-shmkv-container"]["configs"]:
        content = compose()["configs"][given["source"]]["content"]
        d = tmp_path / ("config-" + given["source"])
        d.mkdir()
        path = d / os.path.basename(given["target"])
        path.write_text(content)
        os.chown(path, int(given["uid"]), int(given["gid"]))
        path.chmod(given["mode"])
        binds[os.path.dirname(given["target"])] = str(d)
    made = [p for p in binds if not os.path.exists(p)]
    for p in made:
        os.makedirs(p)
    try:
        yield binds
    finally:
        subprocess.run(["umount", "-l", str(segments)], check=False)
        for p in reversed(made):
            os.rmdir(p)


def stop_container(proc: subprocess.Popen, log) -> None:
    """What `docker compose down` and the kubelet do to a container: SIGTERM to
    its entrypoint, then SIGKILL after 60 s; its log closed."""
    signal_container(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def mount_points(paths: list[str]):
    """The container paths that do not exist here, made as empty mount points (removed after)."""
    made = [p for p in paths if not os.path.exists(p)]
    for p in made:
        os.makedirs(p)
    try:
        yield
    finally:
        for p in reversed(made):
            os.rmdir(p)


def container_env(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment, with the capacity this host can spare."""
    return {**service["environment"], "SHMKV_CAPACITY": "256MiB"}


def process_env(service: dict[str, Any]) -> dict[str, str]:
    """What a process started here needs besides: this interpreter's environment and the repository."""
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **container_env(service)}


@ROOT
@pytest.mark.slow
def test_the_compose_recipe_runs_two_engines_sharing_the_cache(host, start_engine, reference, tmp_path,
                                                               monkeypatch):
    services = compose()["services"]
    binds = [[h, inside] for inside, h in host.items()]
    svc = services["shmkv-daemon"]
    log = open(tmp_path / "daemon.log", "ab")
    daemon = subprocess.Popen(
        [*container_argv(True, private_shm=True, binds=binds, read_only_root=svc["read_only"]), *svc["entrypoint"]],
        stdout=subprocess.PIPE, stderr=log, text=True, env=process_env(svc), cwd="/")
    try:
        line = daemon.stdout.readline()
        assert "shmkv daemon ready" in line, open(tmp_path / "daemon.log").read()
        health = subprocess.run([*container_argv(True, private_shm=True, binds=binds), *svc["healthcheck"]["test"][1:]],
                                capture_output=True, text=True, env=process_env(svc), cwd="/", timeout=60)
        assert health.returncode == 0, health.stderr
        answer = json.loads(health.stdout)
        assert answer["status"] == "ok" and answer["maintainer"], answer

        prompt = random_prompt(3000, seed=43)
        digests = str(tmp_path / "digests.txt")
        engines = {}
        for name in ("vllm-a", "vllm-b"):
            e = services[name]
            extra = kv_transfer_config(e["command"]).get("kv_connector_extra_config", {})
            engines[name] = start_engine(f"recipe-{name}", module_path=None, pid_namespace=True, private_shm=True,
                                         binds=binds, env=container_env(e) | {"SHMKV_DEBUG_DIGEST_FILE": digests},
                                         shmkv=extra)
        first = engines["vllm-a"].generate([prompt])
        assert first["num_cached_tokens"] == [0] and first["outputs"][0] == reference.output(prompt, 0)
        r = engines["vllm-b"].generate([prompt])
        assert r["num_cached_tokens"] == [2944], "11 chunks and the 128-token tail piece, from the other container"
        assert len(r["outputs"][0]) == E2E_TOKENS and r["outputs"][0] == reference.output(prompt, 2944)
        assert check_loaded_bytes_equal_stored(digests) == 12

        settings = yaml.safe_load(open(os.path.join(DEPLOY, "config", "shmkv.yaml")))
        segments = host[services["vllm-a"]["environment"]["SHMKV_SEGMENT_DIR"]]
        assert os.listdir(segments) == [settings["cache_name"]], "the one segment, in the shared tmpfs"
        monkeypatch.setenv("SHMKV_SEGMENT_DIR", segments)
        with Store.attach(settings["cache_name"], populate=False) as s:
            st = s.stats()
        assert st["leases_reclaimed"] == 0 and st["writes_reclaimed"] == 0, st
        state = host[os.path.dirname(services["vllm-a"]["environment"]["SHMKV_RUNTIME_DIR"])]
        assert os.path.isdir(os.path.join(state, "disk", settings["cache_name"])), "the disk tier, in the state dir"
    finally:
        stop_container(daemon, log)
    assert daemon.returncode == 0, open(tmp_path / "daemon.log").read()


@ROOT
@pytest.mark.slow
def test_the_pod_local_variant_runs_its_sidecar_and_two_engines(start_engine, reference, tmp_path):
    """The pod-local recipe in the namespace harness: the pod's emptyDir of
    medium Memory is a tmpfs mounted as kubelet mounts it (root's, mode 1777),
    the sidecar runs its command as written (segments/ made 0700, then the
    daemon), and two engine containers with the recipe's mounts and shmkv
    environment share it: engine 2 loads what engine 1 stored."""
    docs = pod_local_docs()
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    text = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["shmkv.yaml"]
    pod_tmpfs, config = tmp_path / "pod-tmpfs", tmp_path / "config"
    pod_tmpfs.mkdir()
    config.mkdir()
    (config / "shmkv.yaml").write_text(text)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "emptydir-memory", str(pod_tmpfs)], check=True)
    binds = [[str(pod_tmpfs), "/run/shmkv"], [str(config), "/etc/shmkv"]]
    try:
        with mount_points([inside for _, inside in binds]):
            assert oct(os.stat(pod_tmpfs).st_mode & 0o7777) == "0o1777", "a tmpfs mounted as kubelet mounts it"
            (sidecar,) = pod["initContainers"]
            env = {**env_of(sidecar), "SHMKV_CAPACITY": "256MiB"}
            log = open(tmp_path / "sidecar.log", "ab")
            daemon = subprocess.Popen([*container_argv(True, private_shm=True, binds=binds, read_only_root=True),
                                       *sidecar["command"]], stdout=subprocess.PIPE, stderr=log, text=True,
                                      env={**os.environ, "PYTHONPATH": REPO, **env}, cwd="/")
            try:
                assert "shmkv daemon ready" in daemon.stdout.readline(), open(tmp_path / "sidecar.log").read()
                probe = subprocess.run([*container_argv(True, private_shm=True, binds=binds),
                                        *sidecar["startupProbe"]["exec"]["command"]],
                                       capture_output=True, text=True, env={**os.environ, **env}, cwd="/", timeout=60)
                assert probe.returncode == 0 and json.loads(probe.stdout)["status"] == "ok", probe.stderr
                prompt = random_prompt(3000, seed=47)
                engines = []
                for c in pod["containers"]:
                    shmkv_env = {k: v for k, v in env_of(c).items() if k.startswith("SHMKV_")} | {
                        "SHMKV_CAPACITY": "256MiB"}
                    extra = kv_transfer_config(c["args"]).get("kv_connector_extra_config", {})
                    engines.append(start_engine(f"pod-local-{c['name']}", module_path=None, pid_namespace=True,
                                                private_shm=True, binds=binds, env=shmkv_env, shmkv=extra))
                first = engines[0].generate([prompt])
                assert first["num_cached_tokens"] == [0] and first["outputs"][0] == reference.output(prompt, 0)
                r = engines[1].generate([prompt])
                assert r["num_cached_tokens"] == [2944], "11 chunks and the tail piece, from the other container"
                assert r["outputs"][0] == reference.output(prompt, 2944)
                assert os.listdir(pod_tmpfs / "segments") == [yaml.safe_load(text)["cache_name"]]
                assert oct(os.stat(pod_tmpfs / "segments").st_mode & 0o777) == "0o700"
                for e in engines:
                    e.close()
            finally:
                stop_container(daemon, log)  # the kubelet stops the sidecar last
            assert daemon.returncode == 0, open(tmp_path / "sidecar.log").read()
    finally:
        subprocess.run(["umount", "-l", str(pod_tmpfs)], check=False)


@ROOT
@pytest.mark.slow
def test_the_root_variant_runs_its_node_preparation_daemon_and_two_engines(start_engine, reference, tmp_path):
    """deploy/kubernetes/root/ in the namespace harness, as root as it is
    written: prepare-node's script with the init container's environment over
    a stand-in host root (the tmpfs and the state directory, uid 0, 0700),
    then the DaemonSet's container (its command and environment) and two
    engines with the Deployment's shmkv environment, each in PID and mount
    namespaces of its own with the node's two directories at the recipe's
    paths: engine 2 loads what engine 1 stored."""
    root_docs = variant_docs(os.path.join(DEPLOY, "kubernetes", "root"))
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in root_docs
            if d["kind"] in ("DaemonSet", "Deployment")}
    daemon_pod, engine_pod = pods["shmkv-daemon"], pods["vllm"]
    (prep,) = daemon_pod["initContainers"]
    script = next(d for d in root_docs if d.get("metadata", {}).get("name") == "shmkv-node-prep")["data"][
        "prepare-node.sh"]
    text = next(d for d in root_docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "shmkv-config")[
        "data"]["shmkv.yaml"]
    host_root, config = tmp_path / "host", tmp_path / "config"
    (host_root / "run").mkdir(parents=True)
    (host_root / "var" / "lib").mkdir(parents=True)
    config.mkdir()
    (config / "shmkv.yaml").write_text(text)
    prep_env = {**env_of(prep), "HOST_ROOT": str(host_root), "SHMKV_SEGMENTS_SIZE": "512m"}
    r = subprocess.run(["sh", "-c", script], env={**os.environ, **prep_env}, capture_output=True, text=True,
                       timeout=60)
    segments, state = host_root / "run" / "shmkv", host_root / "var" / "lib" / "shmkv"
    try:
        assert r.returncode == 0, r.stderr
        assert prep_env["SHMKV_UID"] == "0"
        for d in (segments, state):
            st = os.stat(d)
            assert (st.st_uid, oct(st.st_mode & 0o777)) == (0, "0o700"), d
        binds = [[str(segments), "/run/shmkv"], [str(state), "/var/lib/shmkv"], [str(config), "/etc/shmkv"]]
        with mount_points([inside for _, inside in binds]):
            container = daemon_pod["containers"][0]
            env = {**env_of(container), "SHMKV_CAPACITY": "256MiB"}
            log = open(tmp_path / "daemon.log", "ab")
            daemon = subprocess.Popen([*container_argv(True, private_shm=True, binds=binds, read_only_root=True),
                                       *container["command"]], stdout=subprocess.PIPE, stderr=log, text=True,
                                      env={**os.environ, "PYTHONPATH": REPO, **env}, cwd="/")
            try:
                assert "shmkv daemon ready" in daemon.stdout.readline(), open(tmp_path / "daemon.log").read()
                engine = engine_pod["containers"][0]
                shmkv_env = {k: v for k, v in env_of(engine).items() if k.startswith("SHMKV_")} | {
                    "SHMKV_CAPACITY": "256MiB"}
                extra = kv_transfer_config(engine["args"]).get("kv_connector_extra_config", {})
                engines = [start_engine(f"root-{i}", module_path=None, pid_namespace=True, private_shm=True,
                                        binds=binds, env=shmkv_env, shmkv=extra) for i in range(2)]
                prompt = random_prompt(3000, seed=51)
                first = engines[0].generate([prompt])
                assert first["num_cached_tokens"] == [0] and first["outputs"][0] == reference.output(prompt, 0)
                r = engines[1].generate([prompt])
                assert r["num_cached_tokens"] == [2944] and r["outputs"][0] == reference.output(prompt, 2944)
                for e in engines:
                    e.close()
            finally:
                stop_container(daemon, log)
            assert daemon.returncode == 0, open(tmp_path / "daemon.log").read()
    finally:
        subprocess.run(["umount", "-l", str(segments)], check=False)
