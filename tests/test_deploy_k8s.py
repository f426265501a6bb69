"""deploy/k8s, checked offline: every manifest against the Kubernetes JSON schemas that
``kubernetes-validate`` ships (strict: unknown fields fail), the ServiceMonitor (a CRD those
schemas lack) structurally, the references between resources, the ``kvroute`` command lines
through the real CLI parser, and ``kubectl kustomize`` composition where kubectl exists."""

from __future__ import annotations

import ast
import copy
import re
import shutil
import subprocess
from argparse import Namespace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.cli_parsing import strict_parser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
# What the downward API would give, to expand $(VAR) in container args the way the kubelet does.
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "kvroute-replica-7d9f-abcde"}
DRAIN_SCRIPT = "kvroute-drain"


Resource = dict[str, Any]


def load_resources(paths: list[Path]) -> list[Resource]:
    resources = []
    for path in paths:
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if document:
                document.setdefault("metadata", {}).setdefault("annotations", {})
                document["metadata"]["annotations"]["test/source"] = path.name
                resources.append(document)
    return resources


def strip_source(resource: Resource) -> Resource:
    clean = copy.deepcopy(resource)
    clean["metadata"]["annotations"].pop("test/source", None)
    if not clean["metadata"]["annotations"]:
        del clean["metadata"]["annotations"]
    return clean


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def resources(kustomization: dict[str, Any]) -> list[Resource]:
    return load_resources([K8S / name for name in kustomization["resources"]])


def by_kind(resources: list[Resource], kind: str) -> dict[str, Resource]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def pod_spec(workload: Resource) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def template_labels(workload: Resource) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: Resource) -> dict[str, Any]:
    (only,) = pod_spec(workload)["containers"]
    return only


def env_values(spec: dict[str, Any], secrets: dict[str, Resource]) -> dict[str, str]:
    """A container's environment as the kubelet would build it (downward API faked)."""
    values = {}
    for var in spec.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            values[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            values[var["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
    return values


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion; a reference to an undefined variable fails the test (the
    kubelet would pass it through literally)."""

    def replace(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in the container's env"
        return env[match.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, arg)


def kvroute_args(workload: Resource, resources: list[Resource]) -> Namespace:
    spec = container(workload)
    assert spec["command"] == ["kvroute"]
    env = env_values(spec, by_kind(resources, "Secret"))
    return strict_parser().parse_args([expand(arg, env) for arg in spec["args"]])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def service_port(service: Resource, port: int) -> dict[str, Any]:
    matches = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert matches, f"service {service['metadata']['name']} has no port {port}"
    return matches[0]


def pods_behind(service: Resource, resources: list[Resource]) -> list[Resource]:
    return [
        r
        for r in resources
        if r["kind"] in WORKLOAD_KINDS and selects(service["spec"]["selector"], template_labels(r))
    ]


def container_port(workload: Resource, target: int | str) -> int:
    ports = container(workload)["ports"]
    if isinstance(target, int):
        assert any(p["containerPort"] == target for p in ports)
        return target
    (match,) = [p["containerPort"] for p in ports if p["name"] == target]
    return match


def resolve_url(url: str, resources: list[Resource]) -> tuple[Resource, int]:
    """The workload a Service URL reaches, and the container port it lands on."""
    parts = urlsplit(url)
    services = by_kind(resources, "Service")
    assert parts.hostname in services, f"{url}: no Service {parts.hostname}"
    service = services[parts.hostname]
    assert parts.port is not None
    port = service_port(service, parts.port)
    (workload,) = pods_behind(service, resources)
    return workload, container_port(workload, port.get("targetPort", port["port"]))


# -- files and schemas --------------------------------------------------------------------------


def test_kustomization_lists_every_manifest(kustomization: dict[str, Any]) -> None:
    listed = kustomization["resources"]
    assert len(set(listed)) == len(listed)
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization.yaml lists missing {name}"
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == set(listed), f"manifests not in kustomization.yaml: {sorted(on_disk - set(listed))}"
    images = {image["name"] for image in kustomization["images"]}
    used = {
        c["image"].split(":")[0]
        for r in load_resources([K8S / name for name in listed])
        if r["kind"] in WORKLOAD_KINDS
        for c in pod_spec(r)["containers"]
    }
    assert {"kvroute-cpu", "kvroute-cuda"} <= used and images <= used


def test_every_manifest_passes_the_kubernetes_schema(resources: list[Resource]) -> None:
    kinds = set()
    for resource in resources:
        if (resource["apiVersion"], resource["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(strip_source(resource), KUBERNETES_VERSION, strict=True)
        kinds.add(resource["kind"])
    expected = {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "Secret", "Namespace"}
    assert expected <= kinds


def test_the_schema_check_rejects_a_broken_manifest(resources: list[Resource]) -> None:
    deployment = strip_source(by_kind(resources, "Deployment")["kvroute-replica"])
    container(deployment)["readinessProbe"]["httpGett"] = {"path": "/health", "port": "http"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = strip_source(by_kind(resources, "Deployment")["kvroute-replica"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_service_monitor_scrapes_the_gateway_and_replica_services(resources: list[Resource]) -> None:
    (monitor,) = [r for r in resources if r["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}
    scraped = [
        s
        for s in by_kind(resources, "Service").values()
        if selects(selector["matchLabels"], s["metadata"]["labels"])
    ]
    assert sorted(s["metadata"]["name"] for s in scraped) == ["kvroute-gateway", "kvroute-replica"]
    assert monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings"}
        assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+s", endpoint["interval"])
        for service in scraped:
            names = [p.get("name") for p in service["spec"]["ports"]]
            assert endpoint["port"] in names, f"{service['metadata']['name']} has no port {endpoint['port']}"


# -- references between resources ---------------------------------------------------------------


def test_workloads_select_their_own_pods(resources: list[Resource]) -> None:
    for workload in (r for r in resources if r["kind"] in WORKLOAD_KINDS):
        labels = template_labels(workload)
        assert selects(workload["spec"]["selector"]["matchLabels"], labels)
        assert labels.get("app.kubernetes.io/part-of") == "kvroute", "the Redis NetworkPolicy admits these"
    for budget in by_kind(resources, "PodDisruptionBudget").values():
        matched = [
            r
            for r in resources
            if r["kind"] in WORKLOAD_KINDS
            and selects(budget["spec"]["selector"]["matchLabels"], template_labels(r))
        ]
        assert len(matched) == 1, budget["metadata"]["name"]


def test_services_select_pods_and_their_ports(resources: list[Resource]) -> None:
    for service in by_kind(resources, "Service").values():
        (workload,) = pods_behind(service, resources)
        for port in service["spec"]["ports"]:
            container_port(workload, port.get("targetPort", port["port"]))


def test_probes_use_ports_the_container_declares(resources: list[Resource]) -> None:
    probed = 0
    for workload in (r for r in resources if r["kind"] in WORKLOAD_KINDS):
        spec = container(workload)
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = spec.get(probe_name)
            if probe is None:
                continue
            probed += 1
            for action in ("httpGet", "tcpSocket"):
                if action in probe:
                    container_port(workload, probe[action]["port"])
            if "httpGet" in probe:
                assert probe["httpGet"]["path"] == "/health"
        assert "readinessProbe" in spec and "livenessProbe" in spec, workload["metadata"]["name"]
    assert probed >= 7


def test_secret_references_exist(resources: list[Resource]) -> None:
    secrets = by_kind(resources, "Secret")
    refs = [
        var["valueFrom"]["secretKeyRef"]
        for workload in resources
        if workload["kind"] in WORKLOAD_KINDS
        for c in pod_spec(workload)["containers"]
        for var in c.get("env", [])
        if "secretKeyRef" in var.get("valueFrom", {})
    ]
    assert len(refs) >= 5
    for ref in refs:
        assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]]["stringData"], ref
    keys = secrets["kvroute-keys"]["stringData"]
    assert {"api-keys", "admin-key", "replica-key", "redis-url"} == set(keys)
    assert all(keys[name].startswith("REPLACE-ME") for name in keys if name != "redis-url"), (
        "placeholders only"
    )


def test_gateway_command_and_service(resources: list[Resource]) -> None:
    gateway = by_kind(resources, "Deployment")["kvroute-gateway"]
    args = kvroute_args(gateway, resources)
    assert args.command == "gateway" and args.host == "0.0.0.0"
    assert args.port == container_port(gateway, "http")
    redis, redis_port = resolve_url(args.redis, resources)
    assert redis["kind"] == "StatefulSet" and redis_port == 6379
    env = env_values(container(gateway), by_kind(resources, "Secret"))
    assert {"KVROUTE_API_KEYS", "KVROUTE_ADMIN_KEY", "KVROUTE_REPLICA_KEY"} <= set(env)
    for url in args.replica:
        resolve_url(url, resources)
    service = by_kind(resources, "Service")["kvroute-gateway"]
    assert pods_behind(service, resources) == [gateway]
    assert container_port(gateway, service_port(service, args.port)["targetPort"]) == args.port
    (hpa,) = by_kind(resources, "HorizontalPodAutoscaler").values()
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "kvroute-gateway")
    assert hpa["spec"]["minReplicas"] >= 2, "several gateway pods share one Redis"
    assert container(gateway)["resources"]["requests"]["cpu"], "CPU utilization needs a CPU request"


def test_replica_registers_its_pod_ip_and_name(resources: list[Resource]) -> None:
    replica = by_kind(resources, "Deployment")["kvroute-replica"]
    args = kvroute_args(replica, resources)
    assert args.command == "replica" and args.host == "0.0.0.0"
    assert args.port == container_port(replica, "http")
    assert args.advertise_url == f"http://{FIELD_VALUES['status.podIP']}:{args.port}"
    assert args.replica_id == FIELD_VALUES["metadata.name"]
    assert args.device == "cuda"
    _, redis_port = resolve_url(args.redis, resources)
    assert redis_port == 6379
    gateway = kvroute_args(by_kind(resources, "Deployment")["kvroute-gateway"], resources)
    assert args.redis == gateway.redis and args.redis_prefix == gateway.redis_prefix
    spec = container(replica)
    assert (
        spec["resources"]["requests"]["nvidia.com/gpu"]
        == spec["resources"]["limits"]["nvidia.com/gpu"]
        == "1"
    )
    (mount,) = spec["volumeMounts"]
    assert mount["readOnly"] is True and mount["mountPath"] == "/models"
    (volume,) = pod_spec(replica)["volumes"]
    assert volume["name"] == mount["name"] and volume["persistentVolumeClaim"]["readOnly"] is True
    assert volume["persistentVolumeClaim"]["claimName"] in by_kind(resources, "PersistentVolumeClaim")
    dockerfile = (K8S.parent / "docker" / "Dockerfile.cuda").read_text(encoding="utf-8")
    assert f"--out {args.model}" in dockerfile, "the default model is the one the image bakes in"


def test_replica_pre_stop_drains_through_every_gateway(resources: list[Resource]) -> None:
    replica = by_kind(resources, "Deployment")["kvroute-replica"]
    spec = container(replica)
    env = env_values(spec, by_kind(resources, "Secret"))
    command = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == DRAIN_SCRIPT
    for name in ("Dockerfile.cuda", "Dockerfile.cpu"):
        dockerfile = (K8S.parent / "docker" / name).read_text(encoding="utf-8")
        assert f"COPY deploy/docker/{DRAIN_SCRIPT}.py /usr/local/bin/{DRAIN_SCRIPT}" in dockerfile
    options = dict(arg.removeprefix("--").split("=", 1) for arg in command[1:])
    # The hook drains the pod's own id (the --replica-id it registered) on each gateway pod.
    assert env["KVROUTE_REPLICA_ID"] == kvroute_args(replica, resources).replica_id
    assert env["KVROUTE_ADMIN_KEY"] == by_kind(resources, "Secret")["kvroute-keys"]["stringData"]["admin-key"]
    assert urlsplit(options["metrics-url"]).port == container_port(replica, "http")
    for target in env["KVROUTE_DRAIN_GATEWAYS"].split(","):
        host, port = target.rsplit(":", 1)
        service = by_kind(resources, "Service")[host]
        assert service["spec"]["clusterIP"] == "None", "a headless Service resolves to every gateway pod"
        assert service["spec"].get("publishNotReadyAddresses") is True
        (gateway,) = pods_behind(service, resources)
        assert gateway["metadata"]["name"] == "kvroute-gateway"
        assert int(port) == kvroute_args(gateway, resources).port
        assert service_port(service, int(port))
    # Grace: the hook's wait, then the replica's own SIGTERM grace for what is left.
    graceful = replica_graceful_shutdown_s()
    budget = float(options["timeout"]) + graceful
    assert pod_spec(replica)["terminationGracePeriodSeconds"] >= budget + 10


def replica_graceful_shutdown_s() -> float:
    """``GRACEFUL_SHUTDOWN_S`` of replica/server.py, read without importing torch."""
    tree = ast.parse((ROOT / "replica" / "server.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "GRACEFUL_SHUTDOWN_S" for t in node.targets
        ):
            return float(ast.literal_eval(node.value))
    raise AssertionError("replica/server.py no longer defines GRACEFUL_SHUTDOWN_S")


def test_redis_is_a_stateful_set_behind_a_headless_governing_service(resources: list[Resource]) -> None:
    (redis,) = by_kind(resources, "StatefulSet").values()
    governing = by_kind(resources, "Service")[redis["spec"]["serviceName"]]
    assert governing["spec"]["clusterIP"] == "None"
    assert pods_behind(governing, resources) == [redis]
    (policy,) = by_kind(resources, "NetworkPolicy").values()
    assert selects(policy["spec"]["podSelector"]["matchLabels"], template_labels(redis))
    (allowed,) = policy["spec"]["ingress"]
    (source,) = allowed["from"]
    for name in ("kvroute-gateway", "kvroute-replica"):
        workload = by_kind(resources, "Deployment")[name]
        assert selects(source["podSelector"]["matchLabels"], template_labels(workload))


# -- composition --------------------------------------------------------------------------------


def test_kustomize_composition_resolves(resources: list[Resource], kustomization: dict[str, Any]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, built)) == sorted(map(key, resources))
    images = {f"{image['newName']}:{image['newTag']}" for image in kustomization["images"]}
    for resource in built:
        if resource["kind"] != "Namespace":
            assert resource["metadata"]["namespace"] == kustomization["namespace"]
        if resource["kind"] in WORKLOAD_KINDS:
            for spec in pod_spec(resource)["containers"]:
                assert spec["image"] in images or spec["image"].startswith("redis:"), spec["image"]
        if (resource["apiVersion"], resource["kind"]) not in CRD_KINDS:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
