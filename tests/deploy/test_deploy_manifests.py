"""The deployment recipes in deploy/ (Kubernetes: the daemon's DaemonSet and a
vLLM Deployment, the root and pod-local variants; Docker Compose) are valid
and grant what README says: each container has its own PID namespace and
/dev/shm and shares two host directories only, the segments' tmpfs and the
state directory (runtime directory and disk tier), as one uid. Validity
comes from the schemas users' tools apply: Kubernetes' own
(kubernetes-validate bundles them) and the Compose specification's
(check-jsonschema bundles it); each is shown able to fail on a broken copy.
The recipes run in tests/deploy/test_deploy_recipes.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest
import yaml
from deploy_recipes import (
    COMPOSE,
    DEPLOY,
    ROOT_ONLY,
    SHARED,
    compose,
    env_of,
    host_paths,
    k8s_docs,
    kv_transfer_config,
    pod_local_docs,
    pod_specs,
    restricted_violations,
    variant_docs,
)


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
