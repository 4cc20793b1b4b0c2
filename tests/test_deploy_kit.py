"""The deployment kit under deploy/, validated without a cluster or a Docker engine.

Kubernetes: a small pyyaml-only renderer (`render`) resolves each kustomization (resources,
components, configMap/secretGenerator, JSON-6902 patches, namespace) so names, labels, ports and
the policy are checked on what would be applied; when `kubectl` is installed, plain
`kubectl kustomize` (no relaxed load restrictor) renders the same directories and must agree. Command lines are parsed with the project's own
argparse parser, and every policy goes through `python -m proxy check`.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE, SIM, PRODUCTION = K8S / "base", K8S / "overlays" / "sim", K8S / "overlays" / "production"
COMPONENT = K8S / "components" / "monitoring"
DASHBOARD = COMPONENT / "vllm-proxy.json"  # inside the component: plain `kubectl kustomize` loads it
COMPOSE = DEPLOY / "compose"
SYSTEMD = DEPLOY / "systemd"
TOKIOS = DEPLOY / "tokios" / "connector.yaml"

# The proxy's drain deadline on SIGTERM (issue 7) that the grace periods below must outlast,
# plus the Deployment's preStop sleep. Keep in step with the proxy's shutdown setting.
DRAIN_DEADLINE_S = 120
PRE_STOP_S = 5
PROXY_PORT = 8080
POLICY_CONFIGMAP = "vllm-proxy-policy"
SECRET = "vllm-proxy-secrets"  # client keys and the vLLM API key; created by the operator (base) or generated (sim)
VLLM_TAG = re.compile(r"^v0\.31\.\d+$")
NOT_NAMESPACED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


# -- helpers ---------------------------------------------------------------------------------

def load_docs(path: Path) -> list:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kustomization(kdir: Path) -> dict:
    return load_docs(kdir / "kustomization.yaml")[0]


def _generator_sources(kdir: Path, gen: dict) -> list[tuple[str, Path]]:
    out = []
    for entry in gen.get("files", []):
        key, sep, rel = entry.partition("=")
        rel = rel if sep else key
        out.append((key if sep else Path(rel).name, (kdir / rel).resolve()))
    return out


def _json_pointer(doc, path: str):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    parent = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    return parent, parts[-1]


def _apply_json6902(obj: dict, ops: list) -> None:
    for op in ops:
        parent, last = _json_pointer(obj, op["path"])
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if op["op"] == "add":
                parent.insert(idx, copy.deepcopy(op["value"]))
            elif op["op"] == "replace":
                parent[idx] = copy.deepcopy(op["value"])
            elif op["op"] == "remove":
                del parent[idx]
            else:
                raise AssertionError(f"unsupported JSON patch op {op['op']}")
        elif op["op"] in ("add", "replace"):
            assert op["op"] == "add" or last in parent, f"replace of a missing key {op['path']}"
            parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del parent[last]
        else:
            raise AssertionError(f"unsupported JSON patch op {op['op']}")


def render(kdir: Path, objs: list[dict] | None = None) -> list[dict]:
    """What `kustomize build kdir` yields, for the features this kit uses (tested against kubectl).
    A component works on the objects of the kustomization that includes it (`objs`)."""
    k = kustomization(kdir)
    objs = [] if objs is None else objs
    for res in k.get("resources", []):
        path = kdir / res
        objs += render(path) if path.is_dir() else load_docs(path)
    for comp in k.get("components", []):
        objs = render(kdir / comp, objs)
    for gen in k.get("secretGenerator", []):
        assert gen.get("options", {}).get("disableNameSuffixHash"), "name hashes are not rendered here"
        data = dict(lit.split("=", 1) for lit in gen.get("literals", []))
        objs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                     "type": "Opaque", "stringData": data})
    for gen in k.get("configMapGenerator", []):
        data = {}
        for key, src in _generator_sources(kdir, gen):
            data[key] = src.read_text(encoding="utf-8")
        opts = gen.get("options", {})
        meta = {"name": gen["name"], "labels": dict(opts.get("labels", {}))}
        if opts.get("annotations"):
            meta["annotations"] = dict(opts["annotations"])
        behavior = gen.get("behavior", "create")
        same = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == gen["name"]]
        if behavior == "create":
            assert not same, f"{kdir}: ConfigMap {gen['name']} generated twice"
            objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
        else:
            assert same, f"{kdir}: {behavior} of an unknown ConfigMap {gen['name']}"
            same[0]["data"] = data if behavior == "replace" else {**same[0].get("data", {}), **data}
    for patch in k.get("patches", []):
        ops = load_docs(kdir / patch["path"])[0]
        assert isinstance(ops, list), f"{patch['path']}: only JSON-6902 patches are rendered here"
        target = patch["target"]
        hits = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{kdir}: patch {patch['path']} matches {len(hits)} objects"
        _apply_json6902(hits[0], ops)
    if k.get("namespace"):
        for o in objs:
            if o["kind"] not in NOT_NAMESPACED:
                o["metadata"]["namespace"] = k["namespace"]
            elif o["kind"] == "Namespace":
                o["metadata"]["name"] = k["namespace"]
    return objs


def rendered(kdir: Path) -> list[dict]:
    return copy.deepcopy(_RENDERED[kdir])


_RENDERED: dict[Path, list[dict]] = {}
for _k in (BASE, SIM, PRODUCTION):
    _RENDERED[_k] = render(_k)
RENDERS = [BASE, SIM, PRODUCTION]
RENDER_IDS = ["base", "sim", "production"]


def find(objs, kind, name=None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs, kind, name) -> dict:
    hits = find(objs, kind, name)
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def workloads(objs) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def pod_labels(w) -> dict:
    return w["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_port(container: dict, ref) -> int | None:
    for p in container.get("ports", []):
        if ref in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def cli(argv: list[str]):
    """Parse a vllm-proxy command line with the project's parser (SystemExit = bad flags)."""
    return build_parser().parse_args(argv)


def container_argv(c: dict) -> list[str]:
    command, args = list(c.get("command", [])), list(c.get("args", []))
    assert command and command[0] == "vllm-proxy", f"container {c['name']} does not run vllm-proxy"
    return command[1:] + args


def run_check(policy_text: str, tmp_path: Path, name: str = "policy.yaml",
              env_names: list[str] = ()) -> subprocess.CompletedProcess:
    """`vllm-proxy check` as the pod runs it: `env_names` set (to placeholders) as its Secret would."""
    path = tmp_path / name
    path.write_text(policy_text, encoding="utf-8")
    env = {**os.environ, **{n: "placeholder" for n in env_names}}
    return subprocess.run([sys.executable, "-m", "proxy", "check", "--config", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


def secret_env(objs) -> list[str]:
    """Environment variables the workloads take from Secrets."""
    return [e["name"] for w in workloads(objs) for c in w["spec"]["template"]["spec"]["containers"]
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]


def policy_of(objs) -> tuple[str, dict]:
    cm = one(objs, "ConfigMap", POLICY_CONFIGMAP)
    assert list(cm["data"]) == ["policy.yaml"], "the policy ConfigMap holds exactly policy.yaml"
    text = cm["data"]["policy.yaml"]
    return text, yaml.safe_load(text)


def proxy_deployment(objs) -> dict:
    return one(objs, "Deployment", "vllm-proxy")


# -- every file ------------------------------------------------------------------------------

YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_the_kit_is_there():
    for path in (BASE, SIM, PRODUCTION, COMPONENT, COMPOSE / "Dockerfile", COMPOSE / "compose.yaml",
                 COMPOSE / "policy.yaml", SYSTEMD / "vllm-proxy.service", SYSTEMD / "vllm-proxy.env",
                 TOKIOS, DEPLOY / "README.md"):
        assert path.exists(), path


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(DEPLOY)) for p in YAML_FILES])
def test_every_yaml_parses(path):
    docs = load_docs(path)
    assert docs, f"{path}: no document"


def test_kustomizations_list_only_existing_files():
    kdirs = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
    assert {BASE, SIM, PRODUCTION, COMPONENT} <= set(kdirs)
    missing = []
    for kdir in kdirs:
        k = kustomization(kdir)
        refs = [kdir / r for r in k.get("resources", []) + k.get("components", [])]
        refs += [kdir / p["path"] for p in k.get("patches", [])]
        for r in refs:
            if not r.exists() or (r.is_dir() and not (r / "kustomization.yaml").exists()):
                missing.append(f"{kdir.relative_to(DEPLOY)}: {r}")
        for gen in k.get("configMapGenerator", []):
            for _, src in _generator_sources(kdir, gen):
                if not src.exists():
                    missing.append(f"{kdir.relative_to(DEPLOY)}: {src}")
                if not src.is_relative_to(kdir):
                    missing.append(f"{kdir.relative_to(DEPLOY)}: {src} is outside the kustomization (load restrictor)")
    assert not missing, missing
    # resource files of a kustomization are k8s objects; patch files are not listed as resources
    for kdir in kdirs:
        for r in kustomization(kdir).get("resources", []):
            if (kdir / r).is_file():
                assert all(isinstance(d, dict) for d in load_docs(kdir / r)), r


def test_dashboard_for_the_configmap():
    """The Grafana dashboard JSON sits in the monitoring component, which makes it a ConfigMap."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(dash, dict) and dash.get("panels"), "a Grafana dashboard with panels"
    assert DASHBOARD.stat().st_size < 900_000, "a ConfigMap holds at most 1 MiB"


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_objects_have_required_fields_and_unique_names(kdir):
    objs = rendered(kdir)
    seen = set()
    for o in objs:
        assert o.get("apiVersion") and o.get("kind"), o
        name = o.get("metadata", {}).get("name")
        assert name and DNS1123.match(name) and len(name) <= 63, f"{o['kind']}: bad name {name!r}"
        key = (o["kind"], name)
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        if o["kind"] not in NOT_NAMESPACED:
            assert o["metadata"].get("namespace") == "vllm-proxy"
    component_files = [COMPONENT / r for r in kustomization(COMPONENT).get("resources", [])]
    for path in component_files:
        for o in load_docs(path):
            assert o.get("apiVersion") and o.get("kind") and o["metadata"].get("name"), path


# -- labels, selectors, ports ----------------------------------------------------------------

@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_workload_selectors_match_their_pod_labels(kdir):
    for w in workloads(rendered(kdir)):
        sel = w["spec"]["selector"]["matchLabels"]
        assert selects(sel, pod_labels(w)), f"{w['kind']}/{w['metadata']['name']}: selector {sel}"
    # no two workloads claim the same pods
    ws = workloads(rendered(kdir))
    for a in ws:
        for b in ws:
            if a is not b:
                assert not selects(a["spec"]["selector"]["matchLabels"], pod_labels(b)), (
                    f"{a['metadata']['name']} selects pods of {b['metadata']['name']}")


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_services_select_workloads_and_target_their_ports(kdir):
    objs = rendered(kdir)
    for svc in find(objs, "Service"):
        backing = [w for w in workloads(objs) if selects(svc["spec"]["selector"], pod_labels(w))]
        assert backing, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            assert port.get("name"), f"Service {svc['metadata']['name']}: name every port"
            target = port.get("targetPort", port["port"])
            for w in backing:
                found = [container_port(c, target) for c in w["spec"]["template"]["spec"]["containers"]]
                assert any(found), f"Service {svc['metadata']['name']} port {target} not in {w['metadata']['name']}"
    proxy_svc = one(objs, "Service", "vllm-proxy")
    assert [(p["name"], p["port"]) for p in proxy_svc["spec"]["ports"]] == [("http", PROXY_PORT)]
    for sts in find(objs, "StatefulSet"):
        governing = one(objs, "Service", sts["spec"]["serviceName"])
        assert governing["spec"].get("clusterIP") == "None", "StatefulSet pods get DNS names from a headless Service"
        assert selects(governing["spec"]["selector"], pod_labels(sts))


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_probes_use_declared_container_ports(kdir):
    for w in workloads(rendered(kdir)):
        for c in w["spec"]["template"]["spec"]["containers"]:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                p = c.get(probe)
                if not p:
                    continue
                action = p.get("httpGet") or p.get("tcpSocket")
                if action:
                    assert container_port(c, action["port"]), f"{w['metadata']['name']}.{probe}: port {action['port']}"


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_proxy_deployment(kdir):
    objs = rendered(kdir)
    d = proxy_deployment(objs)
    spec = d["spec"]
    pod = spec["template"]["spec"]
    assert spec["replicas"] >= 2
    (c,) = pod["containers"]
    args = cli(container_argv(c))
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == PROXY_PORT
    assert container_port(c, "http") == PROXY_PORT
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    # hardening
    assert pod["securityContext"]["runAsNonRoot"] is True or c["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"].get("runAsUser", 0) != 0
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod.get("automountServiceAccountToken") is True, "discovery reads EndpointSlices with the pod's token"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert pod.get("topologySpreadConstraints") or pod.get("affinity", {}).get("podAntiAffinity")
    # a writable /tmp, and the policy ConfigMap mounted as a directory (hot reload sees updates)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    config = Path(args.config)
    policy_mount = mounts[str(config.parent)]
    assert "subPath" not in policy_mount, "subPath mounts never receive ConfigMap updates"
    assert volumes[policy_mount["name"]]["configMap"]["name"] == POLICY_CONFIGMAP
    assert config.name in one(objs, "ConfigMap", POLICY_CONFIGMAP)["data"]
    # shutdown: the grace period outlasts preStop + the drain deadline
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and int(pre_stop[1]) == PRE_STOP_S
    assert pod["terminationGracePeriodSeconds"] >= PRE_STOP_S + DRAIN_DEADLINE_S
    ann = spec["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(PROXY_PORT)
    assert ann["prometheus.io/path"] == "/metrics"
    assert pod["serviceAccountName"] in [s["metadata"]["name"] for s in find(objs, "ServiceAccount")]


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_discovery_rbac_is_minimal(kdir):
    """The proxy may get/list/watch EndpointSlices in its namespace, and nothing else."""
    objs = rendered(kdir)
    sa = proxy_deployment(objs)["spec"]["template"]["spec"]["serviceAccountName"]
    assert not find(objs, "ClusterRole") and not find(objs, "ClusterRoleBinding")
    bindings = [b for b in find(objs, "RoleBinding")
                if {"kind": "ServiceAccount", "name": sa} in b["subjects"]]
    assert len(bindings) == 1
    role = one(objs, "Role", bindings[0]["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    _, policy = policy_of(objs)
    for source in policy["backends_from"]:
        assert source["kubernetes"].get("service"), "EndpointSlices by Service: what the Role allows"
        assert "namespace" not in source["kubernetes"], "the Role is for the proxy's own namespace"


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_pdb_hpa_and_monitor_point_at_the_proxy(kdir):
    objs = rendered(kdir)
    labels = pod_labels(proxy_deployment(objs))
    pdb = one(objs, "PodDisruptionBudget", "vllm-proxy")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    hpa = one(objs, "HorizontalPodAutoscaler", "vllm-proxy")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm-proxy"}
    assert hpa["spec"]["minReplicas"] >= 2
    metrics = hpa["spec"]["metrics"]
    assert [m["resource"]["name"] for m in metrics if m["type"] == "Resource"] == ["cpu"], "CPU: the fallback"
    pods = [m["pods"] for m in metrics if m["type"] == "Pods"]
    if find(objs, "ServiceMonitor"):  # monitoring (and so the Prometheus Adapter) is there
        assert [p["metric"]["name"] for p in pods] == ["vllm_proxy_in_flight_requests"]
        assert pods[0]["target"]["type"] == "AverageValue"
        assert "vllm_proxy_in_flight_requests" in (ROOT / "proxy" / "metrics.py").read_text()
    else:
        assert pods == []
    for mon in find(objs, "ServiceMonitor"):
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        svc = one(objs, "Service", "vllm-proxy")
        assert selects(mon["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
        assert {e["port"] for e in mon["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
        assert mon["spec"]["endpoints"][0]["path"] == "/metrics"


def test_monitoring_only_where_included():
    for kdir in (BASE, SIM):
        assert not find(rendered(kdir), "ServiceMonitor") and not find(rendered(kdir), "PodMonitor")
    prod = rendered(PRODUCTION)
    assert find(prod, "ServiceMonitor")
    # Prometheus scrapes every vLLM pod's own metrics, and the NetworkPolicies let it in
    (mon,) = find(prod, "PodMonitor")
    vllm_sets = find(prod, "StatefulSet")
    for sts in vllm_sets:
        assert selects(mon["spec"]["selector"]["matchLabels"], pod_labels(sts))
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        for ep in mon["spec"]["podMetricsEndpoints"]:
            assert container_port(c, ep["port"]) and ep["path"] == "/metrics"
    vllm_port = container_port(vllm_sets[0]["spec"]["template"]["spec"]["containers"][0], "http")
    admitted = []
    for np in find(prod, "NetworkPolicy"):
        if not all(selects(np["spec"]["podSelector"]["matchLabels"], pod_labels(s)) for s in vllm_sets):
            continue
        for rule in np["spec"]["ingress"]:
            if vllm_port in [p["port"] for p in rule.get("ports", [])]:
                admitted += [peer.get("podSelector", {}).get("matchLabels", {}) for peer in rule["from"]]
    assert {"app.kubernetes.io/name": "prometheus"} in admitted, admitted
    dash = one(prod, "ConfigMap", "vllm-proxy-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(dash["data"]) == ["vllm-proxy.json"]
    gens = kustomization(COMPONENT)["configMapGenerator"]
    assert [src for g in gens for _, src in _generator_sources(COMPONENT, g)] == [DASHBOARD]
    assert dash["data"]["vllm-proxy.json"] == DASHBOARD.read_text(encoding="utf-8")


# -- the policy and the fleet it names -------------------------------------------------------

@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_configmap_policy_passes_check(kdir, tmp_path):
    objs = rendered(kdir)
    text, _ = policy_of(objs)
    result = run_check(text, tmp_path, env_names=secret_env(objs))
    assert result.returncode == 0, result.stderr + result.stdout


VISION_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_policy_discovers_the_statefulsets(kdir):
    """No static list: one Kubernetes source per vLLM StatefulSet, through its own Service, whose
    EndpointSlices report readiness (publishNotReadyAddresses would mark every endpoint ready)."""
    objs = rendered(kdir)
    _, policy = policy_of(objs)
    assert policy["backends"] == []
    covered = {}
    for source in policy["backends_from"]:
        k8s = source["kubernetes"]
        svc = one(objs, "Service", k8s["service"])
        assert not svc["spec"].get("publishNotReadyAddresses"), f"Service {k8s['service']}: readiness must show"
        assert k8s["port"] in [p["name"] for p in svc["spec"]["ports"]]
        (sts,) = [w for w in find(objs, "StatefulSet") if selects(svc["spec"]["selector"], pod_labels(w))]
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
        # the mm-trusted subset is exactly the source marked trust_request_mm_kwargs
        labels = pod_labels(sts)
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        flags = c.get("command", []) + c.get("args", [])
        trusted = bool(source.get("backend", {}).get("trust_request_mm_kwargs"))
        assert (labels.get("mm-trusted") == "true") == trusted, source["name"]
        assert ("--trust-request-mm-kwargs" in flags) == trusted, source["name"]
        covered[sts["metadata"]["name"]] = trusted
    assert set(covered) == {s["metadata"]["name"] for s in find(objs, "StatefulSet")}
    assert any(covered.values())
    assert policy["routing"]["policy"] == "prefix_affinity"
    redis = urlsplit(policy["redis"]["url"])
    svc = one(objs, "Service", redis.hostname)
    assert redis.port in [p["port"] for p in svc["spec"]["ports"]]
    assert {d["name"] for d in policy["deployments"]} >= {"llama-8b", "sql", "qwen-vl"}
    assert {"name": "qwen-vl", "model": VISION_MODEL} in policy["deployments"]


@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_auth_on_and_every_secret_from_a_secret(kdir):
    """Clients need a key; the client keys and the vLLM API key reach the proxy (and vLLM) as env
    vars from the Secret, never as text in the policy ConfigMap."""
    objs = rendered(kdir)
    text, policy = policy_of(objs)
    keys = policy["auth"]["keys"]
    assert keys and all("sha256" not in k for k in keys)
    wanted = {k["key_env"] for k in keys if "key_env" in k}
    for source in policy["backends_from"]:
        backend = source.get("backend", {})
        assert "api_key" not in backend, "a plaintext key would land in the ConfigMap"
        wanted.add(backend["api_key_env"])
    (c,) = proxy_deployment(objs)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    for name in wanted:
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == SECRET and not ref.get("optional"), name
    # vLLM itself requires the same key (it reads VLLM_API_KEY), from the same Secret
    for sts in find(objs, "StatefulSet"):
        (vc,) = sts["spec"]["template"]["spec"]["containers"]
        ref = {e["name"]: e for e in vc["env"]}["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": SECRET, "key": "vllm-api-key"}
    # the Secret: generated with demo keys by the sim overlay only; created by the operator otherwise
    secrets = find(objs, "Secret")
    if kdir == SIM:
        (secret,) = secrets
        assert secret["metadata"]["name"] == SECRET and set(secret["stringData"]) == {"client-api-key", "vllm-api-key"}
    else:
        assert secrets == []
    for value in (s.get("stringData", {}) for s in secrets):
        for v in value.values():
            assert v not in text


def _images(objs) -> list[str]:
    return [c["image"] for w in workloads(objs) for c in w["spec"]["template"]["spec"]["containers"]]


def test_no_latest_image_anywhere():
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix != ".json":
            assert ":latest" not in path.read_text(encoding="utf-8"), path
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for kdir in RENDERS:
        for image in _images(rendered(kdir)):
            name, _, tag = image.rpartition(":")
            assert name and tag and tag != "latest", image
            if name.endswith("vllm/vllm-openai"):
                assert VLLM_TAG.match(tag), image
            if name.endswith("vllm-proxy"):
                assert tag == version, f"{image}: the proxy's release is {version}"
    prod = kustomization(PRODUCTION)["images"]
    assert {i["name"]: i["newTag"] for i in prod} == {"vllm-proxy": version, "vllm/vllm-openai": prod[1]["newTag"]}
    assert VLLM_TAG.match(prod[1]["newTag"])


def test_base_vllm_fleet_flags():
    objs = rendered(BASE)
    stss = find(objs, "StatefulSet")
    assert {s["metadata"]["name"] for s in stss} == {"vllm", "vllm-mm"}
    for sts in stss:
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert c["image"].startswith("vllm/vllm-openai:")
        flags = c["command"] + c["args"]
        assert "--enable-prefix-caching" in flags
        assert "--port=8000" in flags and container_port(c, "http") == 8000
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # text replicas: LoRA adapters loaded at runtime by the proxy
    (c,) = one(objs, "StatefulSet", "vllm")["spec"]["template"]["spec"]["containers"]
    flags = c["command"] + c["args"]
    assert "--enable-lora" in flags and any(f.startswith("--max-loras") for f in flags)
    assert {e["name"]: e.get("value") for e in c["env"]}["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # multimodal replicas: a vision-language model, with request-level mm kwargs trusted
    mm = one(objs, "StatefulSet", "vllm-mm")
    (c,) = mm["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == VISION_MODEL and "--trust-request-mm-kwargs" in c["args"]
    assert pod_labels(mm)["mm-trusted"] == "true"


def test_sim_overlay_runs_the_simulator_without_gpus():
    objs = rendered(SIM)
    sims = {}
    for sts in find(objs, "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert "nvidia.com/gpu" not in json.dumps(pod), "the sim overlay needs no GPU"
        assert c["image"] == proxy_deployment(objs)["spec"]["template"]["spec"]["containers"][0]["image"]
        args = cli(container_argv(c))
        assert args.command == "sim" and args.host == "0.0.0.0"
        assert args.port == container_port(c, "http") == 8000
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # vLLM's key from the Secret: the sim requires it like vLLM does
        assert args.api_key == "$(VLLM_API_KEY)" and "VLLM_API_KEY" in {e["name"] for e in c["env"]}
        sims[sts["metadata"]["name"]] = args
    assert sims["vllm"].model == "meta-llama/Llama-3.1-8B-Instruct" and sims["vllm-mm"].model == VISION_MODEL
    assert dict(sims["vllm"].lora_modules) == {"sql-lora": "/adapters/sql-lora"}
    assert sims["vllm-mm"].trust_request_mm_kwargs and not sims["vllm"].trust_request_mm_kwargs
    # the policy is inherited unchanged from the base
    assert policy_of(objs)[0] == policy_of(rendered(BASE))[0]


# -- kubectl, when installed, renders the same --------------------------------------------------

KUBECTL = shutil.which("kubectl")


OVERLAYS = sorted(p.parent for p in K8S.rglob("kustomization.yaml") if kustomization(p.parent)["kind"] == "Kustomization")


def test_every_kustomization_is_rendered_here():
    assert OVERLAYS == sorted(RENDERS)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
@pytest.mark.parametrize("kdir", RENDERS, ids=RENDER_IDS)
def test_kubectl_kustomize_agrees(kdir):
    """Plain `kubectl kustomize`, as a new user runs it: no relaxed load restrictor."""
    out = subprocess.run([KUBECTL, "kustomize", str(kdir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    ours = rendered(kdir)
    def keys(objs):
        return sorted((o["kind"], o["metadata"]["name"], o["metadata"].get("namespace", "")) for o in objs)

    assert keys(built) == keys(ours)
    for o in built:
        mine = one(ours, o["kind"], o["metadata"]["name"])
        if o["kind"] in ("Deployment", "StatefulSet", "Service"):
            assert o["spec"] == mine["spec"], f"{o['kind']}/{o['metadata']['name']} differs from kubectl's"
        if o["kind"] == "ConfigMap":
            assert o["data"] == mine["data"]


# -- compose ---------------------------------------------------------------------------------

def compose() -> dict:
    return load_docs(COMPOSE / "compose.yaml")[0]


def test_compose_services_reference_existing_files_and_ports(tmp_path):
    c = compose()
    services = c["services"]
    assert {"proxy", "redis", "sim-0", "sim-1", "sim-2"} <= set(services)
    for name, svc in services.items():
        if "build" in svc:
            ctx = (COMPOSE / svc["build"]["context"]).resolve()
            assert ctx == ROOT
            assert (ctx / svc["build"]["dockerfile"]).resolve() == COMPOSE / "Dockerfile"
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
    proxy = services["proxy"]
    args = cli(proxy["command"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    published = [p.split(":") for p in proxy["ports"]]
    assert [int(p[-1]) for p in published] == [args.port]
    # the --config path is inside a bind mount of an existing directory holding policy.yaml
    config = Path(args.config)
    (mount,) = [v for v in proxy["volumes"] if Path(v["target"]) == config.parent]
    source = (COMPOSE / mount["source"]).resolve()
    assert (source / config.name).resolve() == COMPOSE / "policy.yaml"
    assert mount["read_only"] is True
    # hardening
    for name in ("proxy", "sim-0", "sim-1", "sim-2"):
        assert services[name]["read_only"] is True and services[name]["cap_drop"] == ["ALL"]
    # simulated replicas: valid sim command lines, and the image's healthcheck on their port
    sims = {}
    for name in ("sim-0", "sim-1", "sim-2"):
        a = cli(services[name]["command"])
        assert a.command == "sim" and a.host == "0.0.0.0"
        assert services[name]["environment"]["VLLM_PROXY_HEALTH_URL"] == f"http://127.0.0.1:{a.port}/health"
        sims[name] = a
    assert dict(sims["sim-1"].lora_modules) == {"sql-lora": "/adapters/sql-lora"}
    assert sims["sim-2"].trust_request_mm_kwargs
    assert not sims["sim-0"].trust_request_mm_kwargs and not sims["sim-0"].lora_modules
    # the policy names the compose services and ports
    policy = load_docs(COMPOSE / "policy.yaml")[0]
    for b in policy["backends"]:
        url = urlsplit(b["url"])
        assert url.hostname in sims and url.port == sims[url.hostname].port, b
        assert bool(b.get("trust_request_mm_kwargs")) == sims[url.hostname].trust_request_mm_kwargs
    assert {urlsplit(b["url"]).hostname for b in policy["backends"]} == set(sims)
    redis = urlsplit(policy["redis"]["url"])
    assert redis.hostname in services and redis.port == 6379
    result = run_check((COMPOSE / "policy.yaml").read_text(encoding="utf-8"), tmp_path)
    assert result.returncode == 0, result.stderr


def test_dockerfile():
    text = (COMPOSE / "Dockerfile").read_text(encoding="utf-8")
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines() if ln.strip() and not ln.startswith("#")]
    froms = [ln.split()[1] for ln in lines if ln.startswith("FROM ")]
    assert froms and all(f == "python:3.11-slim" for f in froms)
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "EXPOSE 8080" in lines
    (hc,) = [ln for ln in lines if ln.startswith("HEALTHCHECK ")]
    assert '"python"' in hc and "/health" in text and "curl" not in hc
    (entry,) = [ln for ln in lines if ln.startswith("ENTRYPOINT ")]
    assert json.loads(entry.split(None, 1)[1]) == ["vllm-proxy"]
    (cmd,) = [ln for ln in lines if ln.startswith("CMD ")]
    args = cli(json.loads(cmd.split(None, 1)[1]))
    assert args.command == "serve" and args.port == 8080 and args.host == "0.0.0.0"
    # what COPY takes from the build context (the repo root) exists and is not dockerignored
    ignore = (COMPOSE / "Dockerfile.dockerignore").read_text(encoding="utf-8").split()
    for ln in lines:
        if ln.startswith("COPY ") and "--from" not in ln:
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
                assert f"!{src}" in ignore or f"!{src}/" in ignore, f"{src} is excluded by the dockerignore"


# -- systemd ---------------------------------------------------------------------------------

def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: keys may repeat (SystemCallFilter=, Environment=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)\s*(s|min)?", value)
    assert m, value
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def test_systemd_unit_is_hardened():
    svc = unit(SYSTEMD / "vllm-proxy.service")["Service"]
    last = {k: v[-1] for k, v in svc.items()}
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "CapabilityBoundingSet": "", "KillSignal": "SIGTERM",
                       "ExecReload": "/bin/kill -HUP $MAINPID"}.items():
        assert last.get(key) == value, f"{key}={last.get(key)!r}"
    assert last.get("DynamicUser") == "yes" or last.get("User") not in (None, "", "root")
    assert "@system-service" in svc["SystemCallFilter"]
    families = set(last["RestrictAddressFamilies"].split())
    assert {"AF_INET", "AF_INET6", "AF_UNIX"} <= families
    assert last.get("MemoryDenyWriteExecute", "no") == "no", "breaks Python wheels that use libffi closures"
    assert _seconds(last["TimeoutStopSec"]) >= DRAIN_DEADLINE_S


def test_systemd_command_lines_and_env_file():
    svc = unit(SYSTEMD / "vllm-proxy.service")["Service"]
    env = dict(e.split("=", 1) for e in svc["Environment"])
    example = {}
    for line in (SYSTEMD / "vllm-proxy.env").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            example[key.strip()] = value.strip()
    env.update(example)
    for key in ("ExecStartPre", "ExecStart"):
        argv = shlex.split(svc[key][-1])
        assert argv[0] == "/opt/vllm-proxy/bin/vllm-proxy"
        used = {m for a in argv for m in re.findall(r"\$\{(\w+)\}", a)}
        assert used <= set(env), f"{key} uses {used - set(env)} with no default"
        args = cli([re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in argv[1:]])
        assert args.config == "/etc/vllm-proxy/policy.yaml"
    assert args.command == "serve" and args.port == 8080


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    exe = Path(sys.executable).parent / "vllm-proxy"
    if not exe.exists():
        pytest.skip("vllm-proxy console script not installed next to the interpreter")
    text = (SYSTEMD / "vllm-proxy.service").read_text(encoding="utf-8").replace("/opt/vllm-proxy/bin/vllm-proxy", str(exe))
    path = tmp_path / "vllm-proxy.service"
    path.write_text(text, encoding="utf-8")
    out = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


# -- Tokios connector ------------------------------------------------------------------------

def test_tokios_connector_points_at_the_proxy():
    from proxy.app import GETS, INFERENCE

    cfg = load_docs(TOKIOS)[0]
    assert set(cfg) == {"BaseUrl", "Routes", "AllowedPaths"}
    base = urlsplit(cfg["BaseUrl"])
    assert base.scheme == "http" and base.port == PROXY_PORT and base.path == "/v1"
    # the probe reads {BaseUrl}/models; allowed paths are forwarded under BaseUrl
    assert base.path + "/models" in GETS
    assert "/chat/completions" in cfg["AllowedPaths"]
    for p in cfg["AllowedPaths"]:
        assert base.path + p in INFERENCE and p in INFERENCE, f"the proxy does not serve {p}"
    # routes name deployments every shipped policy serves
    policies = [load_docs(ROOT / "policies" / "demo.yaml")[0], load_docs(COMPOSE / "policy.yaml")[0],
                load_docs(BASE / "policy.yaml")[0]]
    assert set(cfg["Routes"]) >= {"llama-8b", "sql"}
    for upstream in cfg["Routes"].values():
        for policy in policies:
            assert upstream in {d["name"] for d in policy["deployments"]}, upstream
