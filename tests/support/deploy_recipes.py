"""What the deployment tests share (tests/deploy/): the recipes in deploy/
read as their tools read them (Kubernetes manifests, the Compose file with
its variables interpolated, the generated variants), and the checks of what
a pod may do (Pod Security's restricted level)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import yaml
from helpers import REPO

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


def variant_docs(directory: str) -> list[dict[str, Any]]:
    docs = []
    for name in ("shmkv-daemonset.yaml", "node-volumes.yaml", "vllm-deployment.yaml"):
        with open(os.path.join(directory, name)) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


# ------------------------------------------------ the pod-local variant ---
POD_LOCAL = os.path.join(DEPLOY, "kubernetes", "pod-local", "vllm-pod-local.yaml")


def pod_local_docs() -> list[dict[str, Any]]:
    with open(POD_LOCAL) as f:
        return [d for d in yaml.safe_load_all(f) if d]
