"""deploy/kubernetes and the image it runs, checked offline: every manifest against the Kubernetes
schemas, every container's command line against the CLI, and the files against each other.
The image's command line, user and port are read from its Dockerfiles by test_images.py.
How the base and its components compose is checked in test_kustomize_compositions.py.

Built-in kinds are validated with `kubernetes-validate`'s strict schemas for one recent
Kubernetes version (an unknown field is an error, as `kubectl apply --validate=strict` makes
it). It has no schema for the custom resources (KEDA's ScaledObject and TriggerAuthentication,
the Prometheus Operator's PodMonitor), so each is validated against a closed schema of the
fields these manifests use, written from the CRDs of KEDA 2.20 and prometheus-operator 0.8x,
whose nested Kubernetes types (ObjectMeta, LabelSelector, the HPA's behavior) are the
Kubernetes schemas' own. A field added to one of them must be added to its schema here too.

A command line is parsed the way `outbox-farm` parses it (click, with the container's
environment), without running it: a misspelt option or a value the CLI refuses fails here.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml

from outbox_farm.cli import main
from outbox_farm.prefork.arbiter import HANDBACK_AT_EXIT, PAST_GRACEFUL
from outbox_farm.prefork.exposition import STALE_AFTER, STOP_TIMEOUT
from outbox_farm.settings import parse_bind
from tests.unit.test_images import exposed_ports, image_command, image_user

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
# The version the manifests are validated against; they use nothing newer than 1.31.
KUBERNETES_VERSION = "1.34"
# The job the alert rules and the dashboard in deploy/ select.
PROMETHEUS_JOB = "outbox-farm"

Resource = dict[str, Any]
# parse(argv, environment): the context `outbox-farm` builds from them (see the fixture).
Parse = Callable[[list[str], Mapping[str, str]], click.Context]


# -- reading the files -------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")


def load(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str, name: str | None = None) -> Resource:
    """The one resource of `kind` (named `name`) in deploy/kubernetes."""
    found = [
        doc
        for path in manifest_files()
        for doc in load(path)
        if doc["kind"] == kind and name in (None, doc["metadata"]["name"])
    ]
    assert len(found) == 1, f"{len(found)} {kind} resources named {name}"
    return found[0]


def deployment() -> Resource:
    return find("Deployment", "outbox-farm")


def migration_job() -> Resource:
    return find("Job", "outbox-farm-migrate")


def console() -> Resource:
    return find("Deployment", "outbox-farm-console")


def pods() -> list[Resource]:
    """Every resource that runs pods from the image."""
    return [deployment(), migration_job(), console()]


def farm_container() -> Resource:
    containers = deployment()["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


# -- 1. schemas ---------------------------------------------------------------------------------

_STRICT = f"v{KUBERNETES_VERSION}.0-local-strict"
_DEFINITIONS_URI = "https://kubernetes.io/api/_definitions.json"


def _k8s(name: str) -> dict[str, str]:
    return {"$ref": f"{_DEFINITIONS_URI}#/$defs/{name}"}


def _closed(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _k8s("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
            "spec": spec,
        },
        "apiVersion",
        "kind",
        "metadata",
        "spec",
    )


STRING = {"type": "string", "minLength": 1}
INTEGER = {"type": "integer", "minimum": 0}
NUMBER_TEXT = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"}
DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"}

# KEDA's postgresql trigger reads these metadata keys (the rest of its parameters come from the
# TriggerAuthentication); any other key is a typo KEDA would ignore.
POSTGRESQL_METADATA = _closed(
    {
        "query": STRING,
        "targetQueryValue": NUMBER_TEXT,
        "activationTargetQueryValue": NUMBER_TEXT,
        "connectionFromEnv": STRING,
        "host": STRING,
        "port": STRING,
        "userName": STRING,
        "dbName": STRING,
        "sslmode": STRING,
        "passwordFromEnv": STRING,
    },
    "query",
    "targetQueryValue",
)

TRIGGER = {
    **_closed(
        {
            "type": STRING,
            "name": STRING,
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
            "authenticationRef": _closed(
                {
                    "name": STRING,
                    "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                },
                "name",
            ),
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
            "useCachedMetrics": {"type": "boolean"},
        },
        "type",
        "metadata",
    ),
    "if": {"properties": {"type": {"const": "postgresql"}}},
    "then": {"properties": {"metadata": POSTGRESQL_METADATA}},
}

CUSTOM_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): _resource(
        "keda.sh/v1alpha1",
        "ScaledObject",
        _closed(
            {
                "scaleTargetRef": _closed(
                    {
                        "apiVersion": STRING,
                        "kind": STRING,
                        "name": STRING,
                        "envSourceContainerName": STRING,
                    },
                    "name",
                ),
                "pollingInterval": INTEGER,
                "cooldownPeriod": INTEGER,
                "initialCooldownPeriod": INTEGER,
                "idleReplicaCount": INTEGER,
                "minReplicaCount": INTEGER,
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "advanced": _closed(
                    {
                        "horizontalPodAutoscalerConfig": _closed(
                            {
                                "name": STRING,
                                "behavior": _k8s(
                                    "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"
                                ),
                            }
                        ),
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                    }
                ),
                "triggers": {"type": "array", "minItems": 1, "items": TRIGGER},
            },
            "scaleTargetRef",
            "triggers",
        ),
    ),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _resource(
        "keda.sh/v1alpha1",
        "TriggerAuthentication",
        _closed(
            {
                "secretTargetRef": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {"parameter": STRING, "name": STRING, "key": STRING},
                        "parameter",
                        "name",
                        "key",
                    ),
                }
            }
        ),
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _resource(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        _closed(
            {
                "jobLabel": STRING,
                "selector": _k8s("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"),
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _closed(
                        {
                            "port": STRING,
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                        },
                        "port",
                    ),
                },
            },
            "selector",
        ),
    ),
}


def _registry() -> referencing.Registry[Any]:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / _STRICT
    definitions = json.loads((folder / "_definitions.json").read_text())
    assert definitions["$id"] == _DEFINITIONS_URI
    resource = referencing.Resource.from_contents(definitions)
    return referencing.Registry().with_resource(_DEFINITIONS_URI, resource)


REGISTRY = _registry()


def validate(doc: Resource) -> None:
    """`doc` against its Kubernetes schema (strict), or against ours for a custom resource;
    raises jsonschema.ValidationError. A kind with neither is a failure, not a pass."""
    schema = CUSTOM_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return
    jsonschema.Draft202012Validator(schema, registry=REGISTRY).validate(doc)


def _documents() -> Iterator[Any]:
    for path in manifest_files():
        for doc in load(path):
            name = f"{path.relative_to(KUBE)}:{doc['kind']}/{doc['metadata']['name']}"
            yield pytest.param(doc, id=name)


@pytest.mark.parametrize("doc", list(_documents()))
def test_every_manifest_validates_against_its_schema(doc: Resource) -> None:
    validate(doc)


def _set(doc: Resource, path: str, value: Any) -> Resource:
    """A copy of `doc` with `value` at `path` (dots; digits index lists)."""
    changed = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = changed
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    return changed


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        # A misspelt field or a value of the wrong type, at least one per schema. (The
        # Kubernetes schemas carry few enums: a misspelt restartPolicy value would pass.)
        ("Deployment/outbox-farm", "spec.template.spec.containers.0.livenesProbe", {}),
        (
            "Deployment/outbox-farm",
            "spec.template.spec.containers.0.securityContext.readOnlyRootFileSystem",
            True,
        ),
        ("Deployment/outbox-farm", "spec.template.spec.securityContext.runAsNonRoot", "yes"),
        ("Deployment/outbox-farm-console", "spec.template.spec.containers.0.args", "console"),
        ("NetworkPolicy", "spec.ingress.0.form", []),
        ("Service", "spec.ports.0.targetport", "console"),
        ("Job", "spec.backofLimit", 2),
        ("PodDisruptionBudget", "spec.maxUnavailabe", 1),
        ("ScaledObject", "spec.pollingIntervall", 30),
        ("ScaledObject", "spec.triggers.0.metadata.targetQueryValu", "5"),
        ("ScaledObject", "spec.triggers.0.metricType", "Average"),
        ("ScaledObject", "spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown.x", 1),
        ("TriggerAuthentication", "spec.secretTargetRef.0.paramter", "connection"),
        ("PodMonitor", "spec.podMetricsEndpoints.0.interval", "15 seconds"),
        ("PodMonitor", "spec.selector.matchLabel", {}),
    ],
)
def test_the_schemas_refuse_a_misspelt_field(kind: str, path: str, value: Any) -> None:
    doc = find(*kind.split("/"))
    validate(doc)  # the control: the file itself passes
    with pytest.raises(jsonschema.ValidationError):
        validate(_set(doc, path, value))


def test_every_manifest_is_listed_by_exactly_one_kustomization_or_component() -> None:
    listed: list[Path] = []
    for kustomization in sorted(KUBE.rglob("kustomization.yaml")):
        spec = yaml.safe_load(kustomization.read_text())
        listed += [kustomization.parent / name for name in spec["resources"]]
    assert sorted(listed) == manifest_files()


# -- 3. command lines -------------------------------------------------------------------------


def cpu(quantity: str) -> float:
    """A Kubernetes CPU quantity in cores: "2", "0.5", "1500m"."""
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion in args and env values: $(NAME) of a defined variable is its value,
    $$ is $, anything else stays as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def environment(pod: Resource, container: Resource) -> dict[str, str]:
    """The variables the container sees from its `env` (the image sets none of the farm's)."""
    containers = {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        field = var["valueFrom"]["resourceFieldRef"]  # the only source these manifests use
        source = containers[field.get("containerName", container["name"])]
        limit = source["resources"]["limits"][field["resource"].removeprefix("limits.")]
        # The downward API rounds up to a whole number of divisors.
        env[var["name"]] = str(math.ceil(cpu(limit) / cpu(field.get("divisor", "1"))))
    return env


def argv(container: Resource, image_entrypoint: list[str], image_cmd: list[str]) -> list[str]:
    """The container's command line: `command` replaces the ENTRYPOINT, `args` the CMD."""
    command = container.get("command", image_entrypoint)
    args = container.get("args", image_cmd if "command" not in container else [])
    return [*command, *args]


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch) -> Parse:
    """parse(argv, env): the context `outbox-farm` builds from that command line and
    environment, every option converted and checked, nothing run. click.UsageError when the
    CLI refuses it. The environment of this test process is left out."""

    def parse(line: list[str], env: Mapping[str, str]) -> click.Context:
        for name in list(os.environ):
            if name.startswith("OUTBOX_FARM_") or name == "PROMETHEUS_MULTIPROC_DIR":
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        program, command_name, *rest = line
        assert program == "outbox-farm"
        parent = click.Context(main, info_name=program)
        command = main.get_command(parent, command_name)
        if command is None:
            raise click.UsageError(f"no such command {command_name!r}")
        return command.make_context(command_name, rest, parent=parent)

    return parse


def test_the_image_runs_a_command_line_the_cli_accepts(parse: Parse) -> None:
    entrypoint, cmd = image_command()
    ctx = parse([*entrypoint, *cmd], {})
    assert ctx.command.name == "start"
    assert exposed_ports() == [str(parse_bind(ctx.params["metrics_bind"])[1])]


def _pod_containers() -> Iterator[Any]:
    for doc in pods():
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield pytest.param(pod, container, id=f"{doc['kind']}/{container['name']}")


@pytest.mark.parametrize(("pod", "container"), list(_pod_containers()))
def test_each_container_runs_a_command_line_the_cli_accepts(
    parse: Parse, pod: Resource, container: Resource
) -> None:
    env = environment(pod, container)
    line = [expand(arg, env) for arg in argv(container, *image_command())]
    ctx = parse(line, env)
    # Each reads its DSN from a file of a Secret mounted in that container.
    dsn_file = Path(ctx.params["dsn_file"])
    assert ctx.params["dsn"] is None
    mounts = {Path(m["mountPath"]): m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes[mounts[dsn_file.parent]]["secret"]
    assert dsn_file.name in {item["path"] for item in secret["items"]}


@pytest.mark.parametrize(
    "line",
    [
        "outbox-farm start myapp.outbox:farm --log-fromat json",
        "outbox-farm strat myapp.outbox:farm",
        "outbox-farm start myapp.outbox:farm --procs 0",
        "outbox-farm start myapp.outbox:farm --metrics-bind 0.0.0.0",
        "outbox-farm migrate --tabel outbox",
    ],
)
def test_a_command_line_the_cli_would_refuse_fails_the_parse(parse: Parse, line: str) -> None:
    parse(["outbox-farm", "start", "myapp.outbox:farm"], {})  # the control
    with pytest.raises(click.UsageError):
        parse(shlex.split(line), {})


# -- 4. the files against each other ------------------------------------------------------------


def farm_context(parse: Parse) -> click.Context:
    pod = deployment()["spec"]["template"]["spec"]
    container = farm_container()
    env = environment(pod, container)
    return parse([expand(arg, env) for arg in argv(container, *image_command())], env)


def test_the_farm_runs_one_worker_per_core_of_its_cpu_limit(parse: Parse) -> None:
    limit = farm_container()["resources"]["limits"]["cpu"]
    assert farm_context(parse).params["procs"] == math.ceil(cpu(limit))


def test_kubernetes_waits_for_the_whole_graceful_stop_before_it_kills(parse: Parse) -> None:
    graceful = farm_context(parse).params["graceful_timeout"]
    # The arbiter's longest stop: the drain, a worker's overrun past it, the hand-back of the
    # rows of a worker it then had to kill, and the /metrics server's own stop.
    longest = graceful + PAST_GRACEFUL + HANDBACK_AT_EXIT + STOP_TIMEOUT
    grace = deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > longest


def test_readiness_asks_healthz_and_liveness_livez_on_the_port_metrics_are_bound_to(
    parse: Parse,
) -> None:
    host, port = parse_bind(farm_context(parse).params["metrics_bind"])
    assert host == "0.0.0.0", "the kubelet and Prometheus must reach it from outside the pod"
    container = farm_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # /healthz is 503 through a database outage, /livez only when the arbiter itself is stuck.
    asked = {
        probe: (container[probe]["httpGet"]["path"], ports.get(container[probe]["httpGet"]["port"]))
        for probe in ("readinessProbe", "livenessProbe", "startupProbe")
    }
    assert asked == {
        "readinessProbe": ("/healthz", port),
        "livenessProbe": ("/livez", port),
        "startupProbe": ("/livez", port),
    }


def test_the_liveness_probe_restarts_a_stuck_arbiter_within_a_minute() -> None:
    probe = farm_container()["livenessProbe"]
    # From the arbiter's last turn: its snapshot goes stale, then the probe's failures add up.
    assert STALE_AFTER + probe["periodSeconds"] * probe["failureThreshold"] <= 60


def test_everything_the_farm_writes_is_on_a_writable_volume(parse: Parse) -> None:
    pod = deployment()["spec"]["template"]["spec"]
    container = farm_container()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    writable = {Path(m["mountPath"]) for m in container["volumeMounts"] if m["name"] in scratch}
    # The metrics directory; the arbiter's state directory is a temporary one, under /tmp.
    metrics_dir = Path(farm_context(parse).params["metrics_dir"])
    assert any(metrics_dir.is_relative_to(mount) for mount in writable)
    assert Path("/tmp") in writable


def _selects(selector: Resource, labels: Mapping[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, "only matchLabels is checked here"
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def test_the_selectors_take_the_farm_pods_and_only_them() -> None:
    farm = deployment()
    labels = farm["spec"]["template"]["metadata"]["labels"]
    others = {
        doc["metadata"]["name"]: doc["spec"]["template"]["metadata"]["labels"]
        for doc in (migration_job(), console())
    }
    selectors = {
        "Deployment": farm["spec"]["selector"],
        "PodDisruptionBudget": find("PodDisruptionBudget")["spec"]["selector"],
        "PodMonitor": find("PodMonitor")["spec"]["selector"],
        "NetworkPolicy": find("NetworkPolicy", "outbox-farm")["spec"]["podSelector"],
    }
    for kind, selector in selectors.items():
        assert _selects(selector, labels), kind
        for name, other in others.items():
            assert not _selects(selector, other), f"{kind} takes the pods of {name}"
    service = find("Service", "outbox-farm-console")["spec"]["selector"]
    assert _selects({"matchLabels": service}, others["outbox-farm-console"])
    assert not _selects({"matchLabels": service}, labels)


def test_the_pod_monitor_scrapes_the_farm_s_metrics_as_the_job_the_rules_expect(
    parse: Parse,
) -> None:
    monitor = find("PodMonitor")["spec"]
    _, bound = parse_bind(farm_context(parse).params["metrics_bind"])
    ports = {p["name"]: p["containerPort"] for p in farm_container()["ports"]}
    endpoints = [(ports.get(e["port"]), e["path"]) for e in monitor["podMetricsEndpoints"]]
    assert endpoints == [(bound, "/metrics")]
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert labels[monitor["jobLabel"]] == PROMETHEUS_JOB


def test_the_scaled_object_scales_the_farm_with_a_secret_of_its_own() -> None:
    scaled = find("ScaledObject")["spec"]
    farm = deployment()
    assert scaled["scaleTargetRef"] == {
        "apiVersion": farm["apiVersion"],
        "kind": farm["kind"],
        "name": farm["metadata"]["name"],
    }
    auth = find("TriggerAuthentication")
    assert {t["authenticationRef"]["name"] for t in scaled["triggers"]} == {
        auth["metadata"]["name"]
    }
    [ref] = auth["spec"]["secretTargetRef"]
    assert ref["parameter"] == "connection"
    # The read-only role's Secret: no pod of the farm mounts it, and KEDA reads none of theirs.
    mounted = {
        volume["secret"]["secretName"]
        for doc in pods()
        for volume in doc["spec"]["template"]["spec"]["volumes"]
        if "secret" in volume
    }
    assert "outbox-farm-dsn" in mounted  # the control: the farm's own Secret is found
    assert ref["name"] not in mounted


def test_the_backlog_count_is_never_cut_below_what_the_largest_farm_needs() -> None:
    scaled = find("ScaledObject")["spec"]
    [trigger] = [t for t in scaled["triggers"] if t["name"] == "ready-rows"]
    assert trigger["metricType"] == "AverageValue"
    limits = {int(n) for n in re.findall(r"LIMIT (\d+)", trigger["metadata"]["query"])} - {1}
    [cap] = limits
    assert cap >= float(trigger["metadata"]["targetQueryValue"]) * scaled["maxReplicaCount"]


def test_pods_run_as_the_image_s_non_root_user_with_nothing_to_escalate() -> None:
    uid, _, gid = image_user().partition(":")
    for doc in pods():
        pod = doc["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True
        assert (str(context["runAsUser"]), str(context["runAsGroup"])) == (uid, gid)
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for container in pod.get("initContainers", []) + pod["containers"]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "privileged": False,
                "capabilities": {"drop": ["ALL"]},
            }
        for volume in pod["volumes"]:
            if "secret" in volume:
                # Readable by the pod's group (fsGroup), by nobody else.
                assert volume["secret"]["defaultMode"] == 0o440
                assert context["fsGroup"] == int(gid)
