"""Kubernetes artefacts: raw manifests, `kubectl kustomize` output and the Helm chart rendered
with several values files pass minimal schemas and cross-object checks (selectors match labels,
mounts name existing volumes, ports and paths agree with the daemon's TOML, memory limits cover
the DRAM arena); the chart renders with `helm template` when helm is on PATH, and always with
deploy/tools/minihelm.py (helm is neither in Debian 12 nor on PyPI)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from deploy_util import CHART, DEPLOY, K8S, ROOT, load_config, minihelm
from kvstore import config as kvconfig
from kvstore.transport.auth import read_secret

# --- Kubernetes ---------------------------------------------------------------------------

NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": NAME, "namespace": NAME, "labels": LABELS, "annotations": LABELS}}
PORT_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 15}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
PROBE = {"type": "object", "minProperties": 1,
         "properties": {"exec": {"type": "object", "required": ["command"],
                                 "properties": {"command": {"type": "array", "minItems": 1, "items": {"type": "string"}}}},
                        "grpc": {"type": "object", "required": ["port"]},
                        "httpGet": {"type": "object", "required": ["port"]},
                        "tcpSocket": {"type": "object", "required": ["port"]},
                        "periodSeconds": {"type": "integer", "minimum": 1},
                        "timeoutSeconds": {"type": "integer", "minimum": 1},
                        "failureThreshold": {"type": "integer", "minimum": 1}},
         "oneOf": [{"required": [h]} for h in ("exec", "grpc", "httpGet", "tcpSocket")]}
CONTAINER = {"type": "object", "required": ["name", "image"], "properties": {
    "name": NAME, "image": {"type": "string", "minLength": 1},
    "ports": {"type": "array", "items": {"type": "object", "required": ["name", "containerPort"], "properties": {
        "name": PORT_NAME, "containerPort": PORT, "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}}},
    "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}},
    "resources": {"type": "object", "required": ["limits"]},
    "startupProbe": PROBE, "readinessProbe": PROBE, "livenessProbe": PROBE}}
SCHEMAS = {
    ("v1", "Namespace"): {},
    ("v1", "ConfigMap"): {"required": ["data"], "properties": {"data": LABELS}},
    ("v1", "Service"): {"required": ["spec"], "properties": {"spec": {"type": "object", "required": ["selector", "ports"],
        "properties": {"selector": LABELS, "ports": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "port"], "properties": {"name": PORT_NAME, "port": PORT}}}}}}},
    ("apps/v1", "DaemonSet"): {"required": ["spec"], "properties": {"spec": {"type": "object", "required": ["selector", "template"],
        "properties": {"selector": {"type": "object", "required": ["matchLabels"], "properties": {"matchLabels": LABELS}},
                       "template": {"type": "object", "required": ["metadata", "spec"], "properties": {
                           "metadata": {"type": "object", "required": ["labels"], "properties": {"labels": LABELS}},
                           "spec": {"type": "object", "required": ["containers", "volumes"], "properties": {
                               "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
                               "initContainers": {"type": "array", "items": CONTAINER},
                               "volumes": {"type": "array", "items": {"type": "object", "required": ["name"],
                                                                      "minProperties": 2}}}}}}}}}},
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {"required": ["spec"], "properties": {"spec": {"type": "object",
        "required": ["selector", "endpoints"], "properties": {
            "selector": {"type": "object", "required": ["matchLabels"]},
            "endpoints": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["port"]}}}}}},
    ("monitoring.coreos.com/v1", "PrometheusRule"): {"required": ["spec"], "properties": {"spec": {"type": "object",
        "required": ["groups"], "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"], "properties": {"rules": {"type": "array", "minItems": 1,
                "items": {"type": "object", "required": ["expr"]}}}}}}}}},
}


def validate_schema(doc: dict) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in SCHEMAS, f"unexpected object {key}"
    schema = {"type": "object", "required": ["apiVersion", "kind", "metadata"],
              "properties": {"metadata": METADATA}, **SCHEMAS[key]}
    schema["properties"] = {"metadata": METADATA, **SCHEMAS[key].get("properties", {})}
    jsonschema.validate({k: v for k, v in doc.items() if k != "__source__"}, schema)


def quantity(q) -> float:
    """A Kubernetes quantity in base units: '10Gi', '512Mi', '2', '500m'."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?", str(q))
    assert m, f"not a quantity: {q!r}"
    mult = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
            "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "m": 1e-3}[m.group(2)]
    return float(m.group(1)) * mult


def check_objects(docs: list[dict], tmp_path: Path, monitoring: bool = True) -> None:
    """Schemas, then everything that must agree across objects and with the daemon's config."""
    for d in docs:
        validate_schema(d)
    kinds = {}
    for d in docs:
        kinds.setdefault(d["kind"], []).append(d)
    (ds,) = kinds["DaemonSet"]
    (svc,) = kinds["Service"]
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), "service selects no daemon pod"
    assert svc["spec"].get("clusterIP") == "None", "peer discovery needs a headless service"

    volumes = {v["name"]: v for v in spec["volumes"]}
    mounted = set()
    for c in spec["containers"] + spec.get("initContainers", []):
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{c['name']} mounts unknown volume {m['name']}"
            mounted.add(m["name"])
    assert mounted == set(volumes), f"volumes nobody mounts: {set(volumes) - mounted}"

    (main,) = [c for c in spec["containers"] if c["name"] == "kvstore"]
    probe_commands = {p: main[p]["exec"]["command"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    sc = main["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["runAsNonRoot"] is True
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    for p in svc["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        assert target in (ports if isinstance(target, str) else ports.values()), f"service port {p} targets nothing"
    assert spec.get("hostIPC") is not True, "the arena is passed as an fd: no hostIPC"

    # The daemon's config, as the pod sees it.
    cm_name = volumes["config"]["configMap"]["name"]
    (cm,) = [c for c in kinds["ConfigMap"] if c["metadata"]["name"] == cm_name]
    cfg = load_config(cm["data"]["kvstore.toml"], tmp_path)
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}

    def mounted_path(path: str) -> bool:
        return any(path == mp or path.startswith(mp.rstrip("/") + "/") for mp in mounts)

    assert mounts.get("/etc/kvstore") == "config"
    assert main["args"][-2:] == ["--config", "/etc/kvstore/kvstore.toml"]
    sock_dir = os.path.dirname(cfg.server.socket_path)
    assert mounts.get(sock_dir) == "socket-dir" and "hostPath" in volumes["socket-dir"], \
        "workers reach the socket through a hostPath directory"
    env = {e["name"]: e.get("value") for e in main.get("env", [])}
    assert env.get("KVSTORE_SERVER_SOCKET_PATH") == cfg.server.socket_path, "`kubectl exec kvstore stats` would look elsewhere"
    for probe, command in probe_commands.items():
        assert command == ["kvstore", "health", "--socket", cfg.server.socket_path], probe
    if cfg.nvme.dir:
        assert mounts.get(cfg.nvme.dir) == "nvme", "the NVMe tier must be on a node volume, not the container fs"
    for section, keys in (("server", ("tls_cert_file", "tls_key_file", "tls_client_ca_file")),
                          ("cluster", ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "redis_password_file",
                                       "redis_ca_file", "redis_cert_file", "redis_key_file"))):
        for key in keys:
            if path := getattr(getattr(cfg, section), key):
                assert mounted_path(path), f"{section}.{key} = {path} is in no mounted volume"
    assert ports["transfer"] == int(cfg.transport.listen.rsplit(":", 1)[1])
    assert ports["metrics"] == cfg.metrics.port and cfg.metrics.host == "0.0.0.0"
    if cfg.server.tcp_listen:
        assert ports["control-tls"] == int(cfg.server.tcp_listen.rsplit(":", 1)[1])
    if cfg.transport.backend == "ucx":
        assert env.get("UCX_MM_ERROR_HANDLING") == "y", "UCX drops its shm transports without it"

    # Memory: the memfd arena and the memory-backed /dev/shm are charged to the container.
    limit = quantity(main["resources"]["limits"]["memory"])
    shm = quantity(volumes["dshm"]["emptyDir"].get("sizeLimit", 0))
    dram = kvconfig.parse_size(tomllib.loads(cm["data"]["kvstore.toml"])["dram"]["capacity_bytes"])
    assert limit >= dram + shm + 2**29, f"memory limit {limit} < DRAM arena {dram} + /dev/shm {shm} + 512Mi"
    req, lim = main["resources"]["requests"], main["resources"]["limits"]
    assert all(quantity(req[k]) == quantity(lim[k]) for k in ("cpu", "memory")), "requests == limits: Guaranteed QoS"
    grace = ds["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    # Warm restart: the preStop drains (SIGUSR1 to the daemon, then waits), the SIGTERM after it
    # writes DRAM out to NVMe within shutdown_grace_s; Kubernetes must not kill it before.
    pre = main["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[:2] == ["/bin/sh", "-c"] and re.fullmatch(r"kill -USR1 1; sleep (\d+)", pre[2]), pre
    drain_s = int(pre[2].rsplit(" ", 1)[1])
    assert grace > drain_s + cfg.server.shutdown_grace_s
    if cfg.nvme.dir:  # time to write the whole DRAM tier at 1 GB/s
        assert cfg.server.shutdown_grace_s >= dram / 1e9, "shutdown_grace_s too short to write DRAM out to NVMe"

    if monitoring:
        (sm,) = kinds["ServiceMonitor"]
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
        assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "kvstore", 'rules expect job="kvstore"'
        (rule,) = kinds["PrometheusRule"]
        assert rule["spec"] == yaml.safe_load((DEPLOY / "prometheus" / "kvstore-rules.yaml").read_text())


def raw_manifests(folder: Path) -> list[dict]:
    docs = []
    for p in sorted(folder.glob("*.yaml")):
        if p.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(p.read_text()) if d]
    return docs


def test_k8s_manifests_validate(tmp_path):
    docs = raw_manifests(K8S) + raw_manifests(K8S / "monitoring")
    check_objects(docs, tmp_path)
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"kvstore"}


def test_k8s_kustomizations_list_every_manifest():
    for folder in (K8S, K8S / "monitoring"):
        k = yaml.safe_load((folder / "kustomization.yaml").read_text())
        assert sorted(k["resources"]) == sorted(p.name for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl not installed (kustomize build is checked where it is)")
def test_kustomize_builds(tmp_path):
    docs = []
    for folder in (K8S, K8S / "monitoring"):
        out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        docs += [d for d in yaml.safe_load_all(out.stdout) if d]
    check_objects(docs, tmp_path)


# --- Helm ---------------------------------------------------------------------------------

HELM_VARIANTS = {
    "defaults": ({}, "kvstore"),
    "everything-on": ({
        "dram": {"capacity": "32GiB"}, "resources": {"requests": {"cpu": "4", "memory": "40Gi"},
                                                     "limits": {"cpu": "4", "memory": "40Gi"}},
        "hbm": {"capacity": "16GiB", "device": "0", "exposeAllGpus": True},
        "transport": {"backend": "ucx", "port": 17470, "ucxProgress": "polling", "accept": "node-1=m1,m2;*=m3"},
        "control": {"tls": {"enabled": True, "port": 17471, "certMode": "csi", "mutual": True,
                            "csi": {"issuerName": "kvstore-fleet-ca", "issuerKind": "ClusterIssuer",
                                    "extraDnsNames": "${POD_NAME}.${POD_NAMESPACE}"},
                            "tokenSecret": {"name": "kvstore-token", "key": "token"}}},
        "metrics": {"port": 19464},
        "hugepages": {"enabled": True, "pageSize": "2Mi", "amount": "4Gi"},
        "grafanaDashboard": {"enabled": True}, "hostNetwork": True, "priorityClassName": "system-node-critical",
        "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
        "extraEnv": [{"name": "UCX_TLS", "value": "rc,sm"}], "podAnnotations": {"team": "inference"},
        "cluster": {"etcdEndpoints": "etcd-0.etcd:2379,etcd-1.etcd:2379", "etcdTls": {"secretName": "etcd-client",
                                                                                     "clientCert": True}},
    }, "cache"),
    "minimal": ({"nvme": {"enabled": False}, "serviceMonitor": {"enabled": False},
                 "prometheusRule": {"enabled": False}, "transport": {"allowUnauthenticated": True}}, "kvstore"),
    "nvme-local-pv": ({"nvme": {"volume": {"persistentVolumeClaim": {"claimName": "kvstore-nvme"}}}}, "kvstore"),
    # One shared certificate: remote clients, and a fleet on etcd without pulls (mutual off).
    "tls-shared-secret": ({"control": {"tls": {"enabled": True, "secretName": "kvstore-tls", "mutual": True}}}, "kvstore"),
    "fleet-without-pulls": ({"cluster": {"etcdEndpoints": "etcd:2379"},
                             "control": {"tls": {"enabled": True, "secretName": "kvstore-tls"}}}, "kvstore"),
    # The prefix directory in a Redis/Valkey cluster, with an ACL user, TLS and a client certificate.
    "redis-directory": ({"cluster": {"etcdEndpoints": "etcd:2379", "directory": {"backend": "redis", "redis": {
        "nodes": "valkey-0.valkey:6379,valkey-1.valkey:6379", "username": "kvstore",
        "passwordSecret": {"name": "kvstore-redis", "key": "acl-password"},
        "tls": {"enabled": True, "secretName": "valkey-client", "clientCert": True},
        "timeoutSeconds": 0.1, "retrySeconds": 5, "keyPrefix": "fleet-a"}}}}, "kvstore"),
}


def chart_values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_chart_metadata_and_values_schema():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvstore" and chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"]) and chart["appVersion"]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version, "appVersion should follow pyproject's version"
    schema = chart_values_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    c = minihelm.Chart(CHART)
    for name, (values, _) in HELM_VARIANTS.items():
        jsonschema.validate(c.values(values), schema)
    for bad in ({"dram": {"capacity": 1000000}}, {"transport": {"backend": "rdma"}}, {"typo": 1},
                {"control": {"tls": {"enabled": True}}}, {"nvme": {"highWatermark": 1.5}},
                {"control": {"tls": {"enabled": True, "certMode": "csi"}}}, {"control": {"tls": {"certMode": "spiffe"}}},
                {"control": {"tls": {"csi": {"issuerKind": "Vault"}}}},
                {"cluster": {"directory": {"backend": "memcached"}}},
                {"cluster": {"directory": {"redis": {"nodes": "valkey-0"}}}},
                {"cluster": {"directory": {"redis": {"timeoutSeconds": 0}}}},
                {"cluster": {"directory": {"redis": {"keyPrefix": "a b"}}}},
                # The chart has no place for the password itself, only for the Secret holding it.
                {"cluster": {"directory": {"redis": {"password": "hunter2hunter2hunter2"}}}},
                {"cluster": {"directory": {"redis": {"passwordSecret": {"name": "s", "value": "hunter2"}}}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(c.values(bad), schema)


@pytest.mark.parametrize("variant", list(HELM_VARIANTS))
def test_chart_renders_and_validates(variant, tmp_path):
    values, release = HELM_VARIANTS[variant]
    chart = minihelm.Chart(CHART)
    docs = minihelm.manifests(chart.render(values, release=release))
    v = chart.values(values)
    check_objects(docs, tmp_path, monitoring=v["serviceMonitor"]["enabled"] and v["prometheusRule"]["enabled"])
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    fullname = "kvstore" if release == "kvstore" else f"{release}-kvstore"
    assert ("DaemonSet", fullname) in names and ("Service", f"{fullname}-peers") in names
    if v["grafanaDashboard"]["enabled"]:
        (cm,) = [d for d in docs if d["metadata"]["name"].endswith("-dashboard")]
        assert json.loads(cm["data"]["kvstore-dashboard.json"]) == \
            json.loads((DEPLOY / "grafana" / "kvstore-dashboard.json").read_text())
    if not v["nvme"]["enabled"]:
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
        assert tomllib.loads(cm["data"]["kvstore.toml"])["nvme"]["dir"] == ""


def _pod(values: dict) -> tuple[dict, dict, dict]:
    """(pod spec, the kvstore container's env by name, volumes by name) of the chart rendered with ``values``."""
    docs = minihelm.manifests(minihelm.Chart(CHART).render(values))
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    (main,) = [c for c in spec["containers"] if c["name"] == "kvstore"]
    return spec, {e["name"]: e for e in main["env"]}, {v["name"]: v for v in spec["volumes"]}


def test_chart_csi_certificates_name_the_node_id_the_daemon_registers_under():
    """With certMode csi each pod's certificate (cert-manager's csi-driver) has CN and a DNS SAN
    ``${POD_NAME}``, and the daemon's node id is ``$(POD_NAME)`` from the pod's own name: the
    name a holder checks a Push's requester against (kvstore/daemon/pull.py check_caller)."""
    values, _ = HELM_VARIANTS["everything-on"]
    spec, env, volumes = _pod(values)
    attrs = volumes["tls"]["csi"]["volumeAttributes"]
    assert volumes["tls"]["csi"]["driver"] == "csi.cert-manager.io" and "secret" not in volumes["tls"]
    assert attrs["csi.cert-manager.io/issuer-name"] == "kvstore-fleet-ca"
    assert attrs["csi.cert-manager.io/issuer-kind"] == "ClusterIssuer"
    assert attrs["csi.cert-manager.io/common-name"] == "${POD_NAME}"
    assert attrs["csi.cert-manager.io/dns-names"].split(",") == ["${POD_NAME}", "${POD_NAME}.${POD_NAMESPACE}"]
    assert {"server auth", "client auth"} <= set(attrs["csi.cert-manager.io/key-usages"].split(","))
    assert attrs["csi.cert-manager.io/fs-group"] == str(spec["securityContext"]["fsGroup"])
    # csi-driver's ${POD_NAME} is the pod's metadata.name; so is the daemon's node id.
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["KVSTORE_CLUSTER_NODE_ID"]["value"] == "$(POD_NAME)"
    assert env["KVSTORE_TRANSPORT_NODE_NAME"]["value"] == "$(NODE_NAME)"  # transport.accept still names nodes
    # Without csi the node id stays the node name, and the certificate a Secret.
    _, env, volumes = _pod(HELM_VARIANTS["fleet-without-pulls"][0])
    assert env["KVSTORE_CLUSTER_NODE_ID"]["value"] == "$(NODE_NAME)" and "POD_NAME" not in env
    assert volumes["tls"]["secret"]["secretName"] == "kvstore-tls"


def test_chart_refuses_pulls_with_one_shared_certificate(tmp_path):
    """etcd + mutual TLS (what pulls need) with the shared Secret fails at render time, saying
    what to set; helm's own `fail` when helm is on PATH."""
    values = {"cluster": {"etcdEndpoints": "etcd:2379"},
              "control": {"tls": {"enabled": True, "secretName": "kvstore-tls", "mutual": True}}}
    with pytest.raises(minihelm.TemplateError, match="control.tls.certMode=csi") as e:
        minihelm.Chart(CHART).render(values)
    assert "PERMISSION_DENIED" in str(e.value)
    with pytest.raises(minihelm.TemplateError, match="control.tls.csi.issuerName is required"):
        minihelm.Chart(CHART).render({"control": {"tls": {"enabled": True, "certMode": "csi"}}})
    if shutil.which("helm"):
        vf = tmp_path / "values.yaml"
        vf.write_text(yaml.safe_dump(values))
        out = subprocess.run(["helm", "template", "kvstore", str(CHART), "-f", str(vf), "--kube-version", KUBE_VERSION],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "control.tls.certMode=csi" in out.stderr


def _daemon_toml(docs: list[dict]) -> str:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "kvstore.toml" in d["data"]]
    return cm["data"]["kvstore.toml"]


def test_chart_directory_defaults_to_the_replica(tmp_path):
    """Unless the backend is redis the config names no store, even with the store's values
    filled in, and no password or store certificate is mounted."""
    redis = HELM_VARIANTS["redis-directory"][0]["cluster"]["directory"]["redis"]
    for values in ({"cluster": {"etcdEndpoints": "etcd:2379"}},
                   {"cluster": {"etcdEndpoints": "etcd:2379", "directory": {"backend": "replica", "redis": redis}}}):
        toml = _daemon_toml(minihelm.manifests(minihelm.Chart(CHART).render(values)))
        cluster = tomllib.loads(toml)["cluster"]
        assert cluster["directory"] == "replica" and not [k for k in cluster if k.startswith("redis_")]
        assert load_config(toml, tmp_path).cluster.directory == "replica"
        spec, _, volumes = _pod(values)
        assert not {"redis-password-src", "redis-password", "redis-tls"} & set(volumes)
        assert [c["name"] for c in spec["initContainers"]] == ["own-host-dirs", "own-transfer-secret"]


def test_chart_redis_directory_reads_its_password_from_a_file(tmp_path):
    """The store's ACL password reaches the daemon only as a file: an init container copies the
    Secret's key into a memory emptyDir as the daemon's user, mode 0400, which is what
    read_secret takes; the ConfigMap, args and env hold its path at most. TLS files are mounted
    from their Secret where the config says."""
    values, _ = HELM_VARIANTS["redis-directory"]
    toml = _daemon_toml(minihelm.manifests(minihelm.Chart(CHART).render(values)))
    c = load_config(toml, tmp_path).cluster
    assert (c.directory, c.redis_nodes_list(), c.redis_username, c.redis_key_prefix) == \
        ("redis", ["valkey-0.valkey:6379", "valkey-1.valkey:6379"], "kvstore", "fleet-a")
    assert (c.redis_timeout_s, c.redis_retry_s) == (0.1, 5.0) and c.endpoints() == ["etcd:2379"]
    assert c.redis_tls and (c.redis_ca_file, c.redis_cert_file, c.redis_key_file) == \
        ("/etc/kvstore/redis-tls/ca.crt", "/etc/kvstore/redis-tls/tls.crt", "/etc/kvstore/redis-tls/tls.key")
    assert [line.strip() for line in toml.splitlines() if "password" in line and not line.strip().startswith("#")] == \
        [f'redis_password_file = "{c.redis_password_file}"']

    spec, env, volumes = _pod(values)
    assert volumes["redis-password-src"]["secret"] == {"secretName": "kvstore-redis", "defaultMode": 0o400}
    assert volumes["redis-password"]["emptyDir"]["medium"] == "Memory"
    (init,) = [i for i in spec["initContainers"] if i["name"] == "own-redis-password"]
    sc = spec["securityContext"]
    assert init["command"] == ["install", "-o", str(sc["runAsUser"]), "-g", str(sc["runAsGroup"]), "-m", "0400",
                               "/etc/kvstore-redis/acl-password", c.redis_password_file]
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == \
        {"redis-password-src": "/etc/kvstore-redis", "redis-password": os.path.dirname(c.redis_password_file)}
    (main,) = [m for m in spec["containers"] if m["name"] == "kvstore"]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert "redis-password-src" not in mounts, "the daemon sees the copy, never the root-owned Secret volume"
    assert mounts["redis-password"]["mountPath"] == os.path.dirname(c.redis_password_file)
    assert mounts["redis-password"]["readOnly"] is True
    refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
    assert "kvstore-redis" not in refs and not any("kvstore-redis" in a for a in main["args"])
    assert volumes["redis-tls"]["secret"] == {"secretName": "valkey-client", "defaultMode": 0o440}
    assert mounts["redis-tls"]["mountPath"] == "/etc/kvstore/redis-tls"

    # What the init container makes (owner: the daemon's user, mode 0400), the daemon reads.
    f = tmp_path / "password"
    f.write_text("s3cret-of-the-acl-user\n")
    os.chmod(f, int(init["command"][6], 8))
    assert read_secret(str(f), "cluster.redis_password_file") == b"s3cret-of-the-acl-user"


def test_chart_redis_directory_tls_with_the_system_cas_and_no_password(tmp_path):
    """TLS without a Secret checks the store against the system's CAs; no passwordSecret, no
    password file (the store's default user)."""
    values = {"cluster": {"etcdEndpoints": "etcd:2379", "directory": {"backend": "redis", "redis": {
        "nodes": "valkey:6379", "tls": {"enabled": True}}}}}
    docs = minihelm.manifests(minihelm.Chart(CHART).render(values))
    check_objects(docs, tmp_path)
    c = load_config(_daemon_toml(docs), tmp_path).cluster
    assert c.redis_tls and not (c.redis_ca_file or c.redis_cert_file or c.redis_password_file or c.redis_username)
    _, _, volumes = _pod(values)
    assert not {"redis-password-src", "redis-password", "redis-tls"} & set(volumes)


@pytest.mark.parametrize("values,message", [
    ({"cluster": {"directory": {"backend": "redis", "redis": {"nodes": "valkey:6379"}}}}, "set cluster.etcdEndpoints"),
    ({"cluster": {"etcdEndpoints": "etcd:2379", "directory": {"backend": "redis"}}}, "set cluster.directory.redis.nodes"),
])
def test_chart_refuses_a_redis_directory_the_daemon_would_refuse(values, message, tmp_path):
    """As the daemon's config check does, at render time; helm's own `fail` when helm is on PATH."""
    with pytest.raises(minihelm.TemplateError, match=re.escape(message)):
        minihelm.Chart(CHART).render(values)
    if shutil.which("helm"):
        vf = tmp_path / "values.yaml"
        vf.write_text(yaml.safe_dump(values))
        out = subprocess.run(["helm", "template", "kvstore", str(CHART), "-f", str(vf), "--kube-version", KUBE_VERSION],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and message in out.stderr


@pytest.mark.parametrize("doc,marker", [("cluster.md", "certMode: csi"), ("deploy.md", "certMode: csi"),
                                        ("deploy.md", "backend: redis")])
def test_the_fleet_values_in_the_docs_render(doc, marker, tmp_path):
    """The fleet values users paste from the docs (per-pod certificates, the directory in a
    Redis/Valkey store) pass the schema and render."""
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / doc).read_text(), re.S) if marker in b]
    assert blocks, f"docs/{doc} shows no fleet values"
    for b in blocks:
        values = yaml.safe_load(b)
        chart = minihelm.Chart(CHART)
        jsonschema.validate(chart.values(values), chart_values_schema())
        check_objects(minihelm.manifests(chart.render(values)), tmp_path)


KUBE_VERSION = "1.30.0"  # within Chart.yaml's kubeVersion; older helm defaults to 1.20


def _helm_docs(text: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


@pytest.mark.skipif(not shutil.which("helm"), reason="helm not on PATH (not in Debian 12 or PyPI; see docs/deploy.md); "
                    "the chart is rendered with deploy/tools/minihelm.py instead")
@pytest.mark.parametrize("variant", list(HELM_VARIANTS))
def test_helm_template_matches_minihelm(variant, tmp_path):
    values, release = HELM_VARIANTS[variant]
    vf = tmp_path / "values.yaml"
    vf.write_text(yaml.safe_dump(values))
    lint = subprocess.run(["helm", "lint", str(CHART), "-f", str(vf), "--kube-version", KUBE_VERSION],
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = subprocess.run(["helm", "template", release, str(CHART), "-n", "kvstore", "-f", str(vf),
                          "--kube-version", KUBE_VERSION],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ours = [{k: v for k, v in d.items() if k != "__source__"}
            for d in minihelm.manifests(minihelm.Chart(CHART).render(values, release=release))]
    assert _helm_docs(out.stdout) == sorted(ours, key=lambda d: (d["kind"], d["metadata"]["name"]))


@pytest.mark.parametrize("value,text", [(7470, "7470"), (0.9, "0.9"), (30, "30"), (999999, "999999"),
                                        (1000000, "1e+06"), (1234567, "1.234567e+06"), (0.0001, "0.0001"),
                                        (0.00001, "1e-05"), (-2.5, "-2.5"), (0, "0")])
def test_minihelm_prints_numbers_as_helm_does(value, text):
    assert minihelm.go_str(value) == text


def test_minihelm_refuses_what_it_does_not_implement(tmp_path):
    for body in ("{{ range .Values.x }}{{ end }}", "{{ $x := 1 }}", "{{ lower .Values.x }}", "{{ .Capabilities.KubeVersion }}"):
        d = tmp_path / body.__hash__().__str__()
        (d / "templates").mkdir(parents=True)
        (d / "Chart.yaml").write_text("name: t\nversion: 0.1.0\n")
        (d / "values.yaml").write_text("x: [1]\n")
        (d / "templates" / "t.yaml").write_text(body)
        with pytest.raises(minihelm.TemplateError):
            minihelm.Chart(d).render()
