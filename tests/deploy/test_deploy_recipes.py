"""The deployment recipes in deploy/ (Kubernetes: the daemon's DaemonSet and a
vLLM Deployment; Docker Compose) are valid and grant what README says: each
container has its own PID namespace and /dev/shm and shares two host
directories only, the segments' tmpfs and the state directory (runtime
directory and disk tier), as one uid.

Validity comes from the schemas users' tools apply: Kubernetes' own
(kubernetes-validate bundles them) and the Compose specification's
(check-jsonschema bundles it); each is shown able to fail on a broken copy.
Then the Compose recipe runs here: its daemon and two vLLM engines, each a
container (`unshare`: PID and mount namespaces, a private /dev/shm, the
daemon's root read-only) with the recipe's volumes at the recipe's paths and
the recipe's environment, the daemon's command and health check as written;
engine 2 loads what engine 1 stored. The harness runs as the test's uid (the
recipe's uid 1000 has no Python here) and shrinks the capacity to 256 MiB
(SHMKV_CAPACITY, which a variable may set over the file)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Any

import pytest
import yaml
from helpers import E2E_TOKENS, REPO, check_loaded_bytes_equal_stored, random_prompt

from shmkv import Store
from shmkv.engines.engine import container_argv, signal_container

DEPLOY = os.path.join(REPO, "deploy")
COMPOSE = os.path.join(DEPLOY, "compose.yaml")
KUBERNETES = [os.path.join(DEPLOY, "kubernetes", f)
              for f in ("shmkv-daemonset.yaml", "node-volumes.yaml", "vllm-deployment.yaml")]
SHARED = {"/run/shmkv", "/var/lib/shmkv"}  # the host directories the recipes share, and nothing else


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="containers (unshare) and mounts need root, as in CI")


def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in KUBERNETES:
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR:-default}` in every string of a loaded file, as `docker compose` does."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), value)
    return value


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The Compose file as `docker compose` reads it (its variables from `env`: none, the defaults)."""
    with open(COMPOSE) as f:
        return interpolate(yaml.safe_load(f), env or {})


def pod_specs() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in k8s_docs()
            if d["kind"] in ("DaemonSet", "Deployment")}


def host_paths(pod: dict[str, Any], namespace: str, docs: list[dict[str, Any]]) -> dict[str, str]:
    """{volume name: the host directory it is}: a hostPath's path, or the
    local path of the PersistentVolume bound to a claim's name."""
    local = {(v["spec"]["claimRef"]["namespace"], v["spec"]["claimRef"]["name"]): v["spec"]["local"]["path"]
             for v in docs if v["kind"] == "PersistentVolume"}
    out = {}
    for v in pod["volumes"]:
        if "hostPath" in v:
            out[v["name"]] = v["hostPath"]["path"]
        elif (namespace, v.get("persistentVolumeClaim", {}).get("claimName")) in local:  # a node's directory
            out[v["name"]] = local[(namespace, v["persistentVolumeClaim"]["claimName"])]
    return out


# What Pod Security's "restricted" level refuses in a pod, as its rules read
# (kubernetes.io/docs/concepts/security/pod-security-standards): the subset a
# recipe could break. None of them: the pod may run in a restricted namespace.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    bad = [f for f in ("hostIPC", "hostPID", "hostNetwork") if pod.get(f)]
    bad += [f"volume {v['name']}: {k}" for v in pod.get("volumes", []) for k in v
            if k != "name" and k not in RESTRICTED_VOLUMES]
    psc = pod.get("securityContext", {})
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = {**psc, **c.get("securityContext", {})}
        if not sc.get("runAsNonRoot") or sc.get("runAsUser") == 0:
            bad.append(f"{c['name']}: may run as root")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{c['name']}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            bad.append(f"{c['name']}: privileged")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or set(sc.get("capabilities", {}).get("add", [])) - {
                "NET_BIND_SERVICE"}:
            bad.append(f"{c['name']}: capabilities are not drop ALL")
        if sc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{c['name']}: no seccomp profile")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{c['name']}: a host port")
    return bad


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment values (those taken from a secret left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def kv_transfer_config(argv: list[str]) -> dict[str, Any]:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


# ------------------------------------------------------------- validity ---
def test_the_kubernetes_manifests_pass_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra installs it")
    from kubernetes_validate.utils import latest_version

    docs = k8s_docs()
    assert {d["kind"] for d in docs} == {"Namespace", "ConfigMap", "DaemonSet", "Deployment", "StorageClass",
                                         "PersistentVolume", "PersistentVolumeClaim", "Service", "ResourceQuota"}
    for doc in docs:
        kubernetes_validate.validate(doc, latest_version(), strict=True)
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")  # a misspelt field, as a hand edit makes
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(daemonset, latest_version(), strict=True)


def check_compose(path: str) -> subprocess.CompletedProcess:
    exe = shutil.which("check-jsonschema") or pytest.skip("check-jsonschema: the test extra installs it")
    return subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", path], capture_output=True, text=True)


def test_the_compose_file_passes_the_compose_specification(tmp_path):
    r = check_compose(COMPOSE)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = compose()
    broken["services"]["vllm-a"]["volumes"] = "/run/shmkv:/run/shmkv"  # a string where a list belongs
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    r = check_compose(str(tmp_path / "compose.yaml"))
    assert r.returncode != 0 and "volumes" in r.stdout + r.stderr, r.stdout + r.stderr


# ------------------------------------------------------------ the grant ---
def test_every_container_shares_two_host_directories_and_nothing_else():
    docs = k8s_docs()
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("DaemonSet", "Deployment")}
    for name, pod in pod_specs().items():
        for field in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"):
            assert not pod.get(field), (name, field)
        mounted = {m["name"] for c in pod["containers"] for m in c["volumeMounts"]}
        paths = {v: p for v, p in host_paths(pod, workloads[name]["metadata"]["namespace"], docs).items()
                 if v in mounted}
        assert set(paths.values()) == SHARED, (name, paths)
        (container,) = pod["containers"]
        assert not container.get("securityContext", {}).get("privileged"), name
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], name
        volumes = {v["name"]: v for v in pod["volumes"]}
        for m in container["volumeMounts"]:
            v = volumes[m["name"]]
            if m["name"] in paths:
                assert m["mountPath"] == paths[m["name"]], (name, m)  # the host's paths, inside too
            elif m["mountPath"] == "/dev/shm":
                assert v["emptyDir"]["medium"] == "Memory", (name, v)  # vLLM's own shared memory, private
    for name, svc in compose()["services"].items():
        for field in ("ipc", "pid", "network_mode", "privileged", "cap_add", "devices"):
            assert field not in svc, (name, field)
        binds = [v.split(":") for v in svc["volumes"]]
        host = {h for h, *_ in binds if h.startswith("/")}
        assert host == SHARED, (name, host)
        assert all(inside == h for h, inside, *_ in binds if h.startswith("/")), (name, binds)
        assert svc["cap_drop"] == ["ALL"], name


def test_only_the_daemon_runs_where_pod_security_is_privileged():
    """The engines' namespace enforces "restricted" and its pods keep its
    rules (a hostPath added to a copy breaks them); the daemon, the one pod
    that mounts host directories, has the privileged namespace to itself.
    The local volumes are the host's directories, on the node they name."""
    docs = k8s_docs()
    levels = {d["metadata"]["name"]: d["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for d in docs if d["kind"] == "Namespace"}
    assert levels == {"shmkv-system": "privileged", "shmkv": "restricted"}, levels
    workloads = [d for d in docs if d["kind"] in ("DaemonSet", "Deployment")]
    assert {d["metadata"]["name"] for d in workloads if levels[d["metadata"]["namespace"]] == "privileged"} == {
        "shmkv-daemon"}
    for d in workloads:
        if levels[d["metadata"]["namespace"]] == "restricted":
            pod = d["spec"]["template"]["spec"]
            assert restricted_violations(pod) == [], d["metadata"]["name"]
            mutated = json.loads(json.dumps(pod))
            mutated["volumes"].append({"name": "host", "hostPath": {"path": "/run/shmkv"}})
            assert restricted_violations(mutated) == ["volume host: hostPath"]
    for pv in (d for d in docs if d["kind"] == "PersistentVolume"):
        assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain", pv["metadata"]["name"]
        (term,) = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
        assert term["matchExpressions"][0]["key"] == "kubernetes.io/hostname"
    claims = {(c["metadata"]["namespace"], c["metadata"]["name"]) for c in docs if c["kind"] == "PersistentVolumeClaim"}
    # every local volume has its claim; the one other claim is the model cache (a storage class's volume)
    assert claims - {("shmkv", "vllm-models")} == {(pv["spec"]["claimRef"]["namespace"], pv["spec"]["claimRef"]["name"])
                                                   for pv in docs if pv["kind"] == "PersistentVolume"}


def test_the_recipes_land_on_gpu_node_pools_and_say_when_they_are_ready():
    """What an operator of a GPU node pool needs of the two workloads: the
    GPU taint tolerated (the daemon asks for no GPU), the daemon evicted
    last, startup and readiness probes, resources; the engines with a model
    cache, an optional Hugging Face token secret, a Service, and pod
    affinity to their node's daemon (the engines that share a host tier
    share the host)."""
    docs = k8s_docs()
    pods = pod_specs()
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for name, pod in pods.items():
        assert gpu_taint in pod.get("tolerations", []), name
        c = pod["containers"][0]
        assert "startupProbe" in c and "readinessProbe" in c and "livenessProbe" in c, name
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], name
    daemon, vllm = pods["shmkv-daemon"], pods["vllm"]
    assert daemon["priorityClassName"] == "system-node-critical"
    assert "nvidia.com/gpu" not in daemon["containers"][0]["resources"].get("limits", {})
    engine = vllm["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] >= 600
    token = next(e for e in engine["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]
    assert token["optional"] is True
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    env = env_of(engine)
    assert mounts[os.path.dirname(env["HF_HOME"])] == "models" and env["VLLM_CACHE_ROOT"].startswith(env["HOME"])
    assert any(v["name"] == "models" and v["persistentVolumeClaim"]["claimName"] == "vllm-models"
               for v in vllm["volumes"])
    (term,) = vllm["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "shmkv-daemon"}
    (service,) = [d for d in docs if d["kind"] == "Service"]
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "vllm"}
    assert service["spec"]["ports"][0]["targetPort"] == engine["ports"][0]["name"]


# What Pod Security's "baseline" level refuses, as its rules read: the subset a recipe could break.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    bad = [f for f in ("hostIPC", "hostPID", "hostNetwork") if pod.get(f)]
    bad += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
        if sc.get("privileged"):
            bad.append(f"{c['name']}: privileged")
        if set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            bad.append(f"{c['name']}: capabilities beyond baseline's")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            bad.append(f"{c['name']}: seccomp unconfined")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{c['name']}: a host port")
    return bad


def variant_docs(directory: str) -> list[dict[str, Any]]:
    docs = []
    for name in ("shmkv-daemonset.yaml", "node-volumes.yaml", "vllm-deployment.yaml"):
        with open(os.path.join(directory, name)) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def test_the_root_variant_is_the_generated_one_and_keeps_its_pod_security_levels(tmp_path):
    """deploy/kubernetes/root/ (vLLM's stock images run as root) is what
    variants.py makes of the uid-1000 recipe, passes Kubernetes' schemas,
    names uid 0 everywhere the recipe names its uid, and each workload keeps
    the Pod Security level of its namespace: the daemon's privileged, the
    engines' baseline ("restricted" refuses root; a hostPath added to a copy
    breaks baseline too)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra installs it")
    from kubernetes_validate.utils import latest_version

    tool = os.path.join(DEPLOY, "kubernetes", "variants.py")
    root = os.path.join(DEPLOY, "kubernetes", "root")
    r = subprocess.run([sys.executable, tool, "--uid", "0", "--check", root], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    stale = tmp_path / "root"
    shutil.copytree(root, stale)
    with open(stale / "vllm-deployment.yaml", "a") as f:
        f.write("# a hand edit\n")
    r = subprocess.run([sys.executable, tool, "--uid", "0", "--check", str(stale)], capture_output=True, text=True)
    assert r.returncode == 1 and "not current" in r.stderr

    docs = variant_docs(root)
    for doc in docs:
        kubernetes_validate.validate(doc, latest_version(), strict=True)
    levels = {d["metadata"]["name"]: d["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for d in docs if d["kind"] == "Namespace"}
    assert levels == {"shmkv-system": "privileged", "shmkv": "baseline"}
    for d in docs:
        if d["kind"] not in ("DaemonSet", "Deployment"):
            continue
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 0 and pod["securityContext"]["runAsNonRoot"] is False
        assert all(e["value"] == "0" for c in pod.get("initContainers", []) for e in c.get("env", [])
                   if e["name"] == "SHMKV_UID")
        if levels[d["metadata"]["namespace"]] == "baseline":
            assert baseline_violations(pod) == [], d["metadata"]["name"]
            assert restricted_violations(pod), "root is refused at restricted: why the engines run at baseline"
            mutated = json.loads(json.dumps(pod))
            mutated["volumes"].append({"name": "host", "hostPath": {"path": "/run/shmkv"}})
            assert baseline_violations(mutated) == ["volume host: hostPath"]


def test_the_node_is_prepared_by_the_daemons_init_container_alone():
    """Without systemd on the node: the daemon pod's one init container runs
    deploy/host/prepare-node.sh (the ConfigMap carries its text), privileged,
    with the host's /run (propagation Bidirectional) and /var/lib, the
    parents of the two shared directories and nothing else; the daemon sees
    the tmpfs mounted after its volumes (HostToContainer). No other pod has
    an init container or a privileged container."""
    docs = k8s_docs()
    pods = pod_specs()
    with open(os.path.join(DEPLOY, "host", "prepare-node.sh")) as f:
        script = f.read()
    (prep_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "shmkv-node-prep"]
    assert prep_map["data"]["prepare-node.sh"] == script
    daemon = pods["shmkv-daemon"]
    (init,) = daemon["initContainers"]
    assert init["securityContext"]["privileged"] and init["command"] == ["sh", "/opt/shmkv/prepare-node.sh"]
    host = {v["name"]: v["hostPath"]["path"] for v in daemon["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert {host[n] for n in mounts if n in host} == {os.path.dirname(p) for p in SHARED}
    assert mounts["host-run"]["mountPropagation"] == "Bidirectional"
    (seg,) = [m for m in daemon["containers"][0]["volumeMounts"] if m["mountPath"] == "/run/shmkv"]
    assert seg["mountPropagation"] == "HostToContainer"
    for name, pod in pods.items():
        if name != "shmkv-daemon":
            assert not pod.get("initContainers"), name
        assert not any(c.get("securityContext", {}).get("privileged") for c in pod["containers"]), name


@ROOT_ONLY
def test_the_node_preparation_is_idempotent(tmp_path):
    """prepare-node.sh in a mount namespace of its own over a stand-in host
    root: a tmpfs of the uid, mode 0700, at run/shmkv (huge=within_size where
    the kernel has it) and the state directory; a second run changes nothing."""
    script = os.path.join(DEPLOY, "host", "prepare-node.sh")
    run = f"HOST_ROOT={tmp_path} SHMKV_SEGMENTS_SIZE=16m sh {script} && HOST_ROOT={tmp_path} sh {script} && " \
          f"grep ' {tmp_path}/run/shmkv ' /proc/self/mounts && stat -c %u:%a {tmp_path}/var/lib/shmkv"
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", run], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sum(ln.startswith("prepare-node: mounted") for ln in lines) == 1, lines  # the second run mounts nothing
    assert sum(ln.startswith("prepare-node: ready") for ln in lines) == 2, lines
    mount = next(ln for ln in lines if ln.startswith("shmkv ") and " tmpfs " in ln)
    assert "mode=700" in mount and "uid=1000" in mount, mount
    assert lines[-1] == "1000:700", lines


def test_the_recipes_agree_on_the_uid_the_settings_and_the_commands():
    pods, services = pod_specs(), compose()["services"]
    envs = [env_of(p["containers"][0]) for p in pods.values()] + [s["environment"] for s in services.values()]
    envs = [{k: v for k, v in e.items() if k.startswith("SHMKV_")} for e in envs]  # shmkv's: the same everywhere
    assert all(e == envs[0] for e in envs), envs
    env = envs[0]
    assert env["SHMKV_SEGMENT_DIR"] in SHARED
    assert os.path.dirname(env["SHMKV_RUNTIME_DIR"]) in SHARED
    uids = {p["securityContext"]["runAsUser"] for p in pods.values()} | {
        int(s["user"].split(":")[0]) for s in services.values()}
    assert len(uids) == 1, uids
    (uid,) = uids
    # the host's preparation: prepare-node.sh's two directories, with the same uid (its unit's one line)
    with open(os.path.join(DEPLOY, "host", "shmkv-prepare-node.service")) as f:
        unit = f.read()
    assert re.search(rf"^Environment=SHMKV_UID={uid} .*HOST_ROOT=/$", unit, re.M), unit
    with open(os.path.join(DEPLOY, "host", "prepare-node.sh")) as f:
        script = f.read()
    assert f'seg="$root{env["SHMKV_SEGMENT_DIR"]}"' in script
    assert f'state="$root{os.path.dirname(env["SHMKV_RUNTIME_DIR"])}"' in script
    # Compose's uid is one variable, the same default; set, it is every container's
    assert {s["user"] for s in compose({"SHMKV_UID": "0"})["services"].values()} == {"0:0"}
    # one settings file: the ConfigMaps and Compose's inline config carry config/shmkv.yaml's text
    with open(os.path.join(DEPLOY, "config", "shmkv.yaml")) as f:
        text = f.read()
    config_maps = [d for d in k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "shmkv-config"]
    # ^ one per namespace
    assert len(config_maps) == 2 and all(c["data"]["shmkv.yaml"] == text for c in config_maps)
    assert compose()["configs"]["shmkv.yaml"]["content"] == text
    # written by Compose itself, root's and read-only: shmkv takes it whoever cloned the repository
    (given,) = compose()["x-shmkv-container"]["configs"]
    assert (given["uid"], given["gid"], given["mode"], given["target"]) == ("0", "0", 0o444, env["SHMKV_CONFIG_FILE"])
    settings = yaml.safe_load(text)
    shared_state = os.path.dirname(env["SHMKV_RUNTIME_DIR"])
    assert settings["disk_dir"].startswith(shared_state + "/")
    assert settings["listen"].startswith("unix:" + env["SHMKV_RUNTIME_DIR"] + "/")
    # the daemon's command, and each engine's connector
    daemon = pods["shmkv-daemon"]["containers"][0]
    assert daemon["command"] == services["shmkv-daemon"]["entrypoint"]
    assert daemon["securityContext"]["readOnlyRootFilesystem"] and services["shmkv-daemon"]["read_only"]
    assert daemon["livenessProbe"]["exec"]["command"] == services["shmkv-daemon"]["healthcheck"]["test"][1:]
    engines = [pods["vllm"]["containers"][0]["args"]]
    engines += [s["command"] for n, s in services.items() if n != "shmkv-daemon"]
    assert [kv_transfer_config(a) for a in engines] == [{"kv_connector": "ShmKVConnector", "kv_role": "kv_both"}] * 3


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


# ------------------------------------------------ the pod-local variant ---
POD_LOCAL = os.path.join(DEPLOY, "kubernetes", "pod-local", "vllm-pod-local.yaml")


def pod_local_docs() -> list[dict[str, Any]]:
    with open(POD_LOCAL) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def test_the_pod_local_variant_is_valid_and_restricted():
    """The daemon as a native sidecar and the engines in one pod, sharing one
    emptyDir of medium Memory; no hostPath: the pod keeps the "restricted"
    level its namespace enforces (a hostPath added to a copy breaks it)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra installs it")
    from kubernetes_validate.utils import latest_version

    docs = pod_local_docs()
    for doc in docs:
        kubernetes_validate.validate(doc, latest_version(), strict=True)
    (ns,) = [d for d in docs if d["kind"] == "Namespace"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    mutated = json.loads(json.dumps(pod))
    mutated["volumes"].append({"name": "host", "hostPath": {"path": "/run/shmkv"}})
    assert restricted_violations(mutated) == ["volume host: hostPath"]
    (sidecar,) = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always" and "startupProbe" in sidecar
    shared = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
    assert shared == {"shmkv"}
    for c in [sidecar, *pod["containers"]]:
        assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["shmkv"] == "/run/shmkv", c["name"]
        env = env_of(c)
        assert env["SHMKV_SEGMENT_DIR"].startswith("/run/shmkv/") and env["SHMKV_RUNTIME_DIR"].startswith("/run/shmkv/")
    settings = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["shmkv.yaml"])
    assert "disk_dir" not in settings, "an emptyDir on disk is 0777 without the sticky bit: no disk tier"


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
