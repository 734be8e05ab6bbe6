"""deploy/kubernetes as kustomize composes it: the base alone holds only built-in kinds (so a
cluster without KEDA or the Prometheus Operator accepts it) and runs a fixed count of pods; the
base with the KEDA and Prometheus Operator components (deploy/overlays/full) is the whole set,
the ScaledObject then owning the replica count. Every composition validates and runs one image.
Also the NetworkPolicy around /metrics and the console's recipe (token, TLS). Built by
tests/unit/kustomize.py, which does what `kustomize build` does for the fields used here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from outbox_farm.console.security import Tokens, check_bind, check_transport
from outbox_farm.errors import ConfigurationError
from outbox_farm.settings import parse_bind
from tests.docs.blocks import blocks
from tests.unit.kustomize import KustomizeError, Resource, build, containers
from tests.unit.test_kubernetes_manifests import (
    CUSTOM_SCHEMAS,
    KUBE,
    Parse,
    argv,
    environment,
    expand,
    farm_container,
    image_command,
    parse,  # noqa: F401 (the fixture)
    validate,
)

DEPLOY = KUBE.parent
FULL = DEPLOY / "overlays" / "full"
COMPONENTS = KUBE / "components"
# What deploy/kubernetes applied before it was split into a base and components.
WHOLE_SET = {
    ("Deployment", "outbox-farm"),
    ("PodDisruptionBudget", "outbox-farm"),
    ("PodMonitor", "outbox-farm"),
    ("ScaledObject", "outbox-farm"),
    ("TriggerAuthentication", "outbox-farm-keda"),
}
CUSTOM_GROUPS = {api_version.split("/")[0] for api_version, _ in CUSTOM_SCHEMAS}


def ids(resources: list[Resource]) -> set[tuple[str, str]]:
    return {(r["kind"], r["metadata"]["name"]) for r in resources}


def the(resources: list[Resource], kind: str, name: str) -> Resource:
    [found] = [r for r in resources if (r["kind"], r["metadata"]["name"]) == (kind, name)]
    return found


def overlay(folder: Path, *components: str) -> Path:
    """An overlay in `folder` (outside deploy/, as a user's own): the base and `components`."""
    folder.mkdir(exist_ok=True)
    spec = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(KUBE)],
        "components": [str(COMPONENTS / name) for name in components],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return folder


def test_the_base_holds_only_built_in_kinds_and_runs_a_fixed_count_of_pods() -> None:
    base = build(KUBE)
    groups = {r["apiVersion"].split("/")[0] for r in base}
    assert not groups & CUSTOM_GROUPS, groups
    assert ids(base) == {
        ("Deployment", "outbox-farm"),
        ("PodDisruptionBudget", "outbox-farm"),
        ("NetworkPolicy", "outbox-farm"),
    }
    farm = the(base, "Deployment", "outbox-farm")
    # Two at least, so the PodDisruptionBudget (one pod at a time) lets a node drain.
    assert farm["spec"]["replicas"] >= 2
    pdb = the(base, "PodDisruptionBudget", "outbox-farm")
    assert pdb["spec"]["maxUnavailable"] < farm["spec"]["replicas"]


def test_the_full_overlay_is_the_base_with_keda_and_the_prometheus_operator() -> None:
    base, full = build(KUBE), build(FULL)
    assert ids(full) == WHOLE_SET | ids(base)
    assert {r["apiVersion"].split("/")[0] for r in full} >= CUSTOM_GROUPS
    # The ScaledObject owns the replica count; nothing else of the base changed.
    farm = the(full, "Deployment", "outbox-farm")
    assert "replicas" not in farm["spec"]
    expected = copy.deepcopy(the(base, "Deployment", "outbox-farm"))
    del expected["spec"]["replicas"]
    assert farm == expected
    for kind, name in ids(base) - {("Deployment", "outbox-farm")}:
        assert the(full, kind, name) == the(base, kind, name)


@pytest.mark.parametrize(
    "components",
    [(), ("keda",), ("prometheus-operator",), ("console",), ("keda", "prometheus-operator")],
)
def test_each_composition_validates_and_runs_one_image(
    tmp_path: Path, components: tuple[str, ...]
) -> None:
    built = build(overlay(tmp_path / "overlay", *components))
    for resource in built:
        validate(resource)
    images = {c["image"] for r in built for c in containers(r)}
    [migrate_image] = {c["image"] for r in build(KUBE / "migrate") for c in containers(r)}
    assert images == {migrate_image}
    assert ":" in migrate_image, "a tag, not latest"


def test_full_is_the_overlay_a_user_would_write(tmp_path: Path) -> None:
    assert build(FULL) == build(overlay(tmp_path / "mine", "keda", "prometheus-operator"))


def test_an_overlay_below_its_base_is_refused_as_kustomize_refuses_it(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "overlay").mkdir(parents=True)
    (base / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: []\n"
    )
    beside = overlay(tmp_path / "beside")
    build(beside)  # the control: the same overlay beside the base builds
    (base / "overlay" / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [..]\n"
    )
    with pytest.raises(KustomizeError, match="cycle detected"):
        build(base / "overlay")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("namePrefix", "x-"),  # a field this build does not apply
        ("patches", [{"target": {"kind": "Deploymnet"}, "patch": "[]"}]),  # matches nothing
        ("patches", [{"target": {"kind": "Deployment"}, "patch": "spec: {replicas: 3}"}]),
    ],
)
def test_what_the_build_does_not_apply_is_refused(
    tmp_path: Path, field: str, value: object
) -> None:
    folder = overlay(tmp_path / "overlay")
    build(folder)  # the control
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    spec[field] = value
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(KustomizeError):
        build(folder)


# -- the NetworkPolicy around /metrics -----------------------------------------------------------


def test_the_network_policy_admits_only_prometheus_and_only_to_the_metrics_port() -> None:
    policy = the(build(KUBE), "NetworkPolicy", "outbox-farm")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    ports = {p["name"]: p["containerPort"] for p in farm_container()["ports"]}
    assert [(p["port"], p["protocol"]) for p in rule["ports"]] == [("metrics", "TCP")]
    assert set(ports) == {"metrics"}, "a port the policy does not admit"
    # One peer naming both a namespace and its pods: the two selectors must match together (as
    # two peers, either alone would admit its whole side).
    [peer] = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}
    assert all(selector["matchLabels"] for selector in peer.values())


def test_the_deploying_guide_shows_keda_s_role_as_it_ships() -> None:
    def statements(text: str) -> list[str]:
        return [line for line in text.splitlines() if line and not line.startswith("--")]

    guide = DEPLOY.parent / "docs" / "guides" / "deploying.md"
    [shown] = [b.code for b in blocks(guide) if b.language == "sql"]
    shipped = (COMPONENTS / "keda" / "keda-role.sql").read_text()
    assert statements(shown) == statements(shipped)
    assert len(statements(shipped)) == 4


# -- the console --------------------------------------------------------------------------------


def test_the_console_serves_https_with_tokens_from_its_secrets(
    tmp_path: Path,
    parse: Parse,  # noqa: F811
) -> None:
    built = build(overlay(tmp_path / "overlay", "console"))
    console = the(built, "Deployment", "outbox-farm-console")
    assert console["spec"]["replicas"] == 1, "sessions are signed by one process' key"
    pod = console["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = environment(pod, container)
    ctx = parse([expand(arg, env) for arg in argv(container, *image_command())], env)
    assert ctx.command.name == "console"
    params = ctx.params
    host, port = parse_bind(params["bind"])
    # Each file the console reads comes from a Secret mounted where it looks.
    mounts = {Path(m["mountPath"]): m["name"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    for option in ("dsn_file", "token_file", "tls_cert", "tls_key"):
        path = Path(params[option])
        items = secrets[mounts[path.parent]]["items"]
        assert path.name in {item["path"] for item in items}, option
    # It would start: a reachable bind with tokens and TLS passes the console's own checks.
    check_bind(host, Tokens({"ops": "x" * 16}))
    check_transport(host, tls=True, behind_tls_proxy=False)
    with pytest.raises(ConfigurationError):  # the control: without a token it would not
        check_bind(host, Tokens({}))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service = the(built, "Service", "outbox-farm-console")["spec"]
    assert [ports[p["targetPort"]] for p in service["ports"]] == [port]
