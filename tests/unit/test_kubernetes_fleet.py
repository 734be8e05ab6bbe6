"""deploy/'s fleet (many outboxes, docs/guides/many-outboxes.md), checked offline the way
test_kubernetes_manifests.py and test_kustomize_compositions.py check the single farm: the
components/fleet and components/fleet-keda components, the migration Job of a fleet, and the
overlays deploy/overlays/fleet and deploy/overlays/fleet/migrate, each built by
tests/unit/kustomize.py, validated against the strict schemas (and the KEDA CRD's for the
ScaledObject), their command lines parsed by the CLI, and the files read by the code that reads
them in a pod: the databases file by the fleet's own reader, KEDA's query on a real database as
the role keda-role.sql makes.

The new files also pass the checks of test_kubernetes_manifests.py, which reads every manifest
under deploy/kubernetes (each validates, each is listed by one kustomization). That is why the
fleet's ScaledObject and migration Job are the single farm's, patched, rather than second ones.
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_farm.fleet.databases import read_file
from outbox_farm.fleet.metrics import fleet_metrics
from tests.unit.kustomize import KustomizeError, Resource, build, containers
from tests.unit.test_images import image_command
from tests.unit.test_kubernetes_manifests import (
    PROMETHEUS_JOB,
    Parse,
    argv,
    environment,
    expand,
    parse,  # noqa: F401 (the fixture)
    validate,
)
from tests.unit.test_kustomize_compositions import COMPONENTS, DEPLOY, FULL, ids, overlay, the

FLEET = DEPLOY / "overlays" / "fleet"
FLEET_MIGRATE = FLEET / "migrate"
BASE_MIGRATE = COMPONENTS.parent / "migrate"
FLEET_KEDA = COMPONENTS / "fleet-keda"
# Where the app's Fleet reads its databases file: the path the component's comment, the
# ConfigMap's comment and the guide's app give.
DATABASES_FILE = Path("/etc/outbox-farm/fleet/databases.toml")
APP = "app:fleet"


# -- helpers -------------------------------------------------------------------------------------


def tenant_secrets() -> dict[str, dict[str, str]]:
    """The Secrets the fleet component's comment tells to create (`kubectl create secret
    generic NAME --from-literal=KEY=...`), each key given a distinct stand-in value."""
    text = (COMPONENTS / "fleet" / "kustomization.yaml").read_text()
    commands = re.findall(r"kubectl create secret generic ([\w-]+)((?:[^\n]*\\\n)*[^\n]*)", text)
    assert commands, "the component says which Secret to create"
    return {
        name: {key: f"pw-{key}" for key in re.findall(r"--from-literal=([\w-]+)=", rest)}
        for name, rest in commands
    }


def pod_environment(pod: Resource, container: Resource) -> dict[str, str]:
    """`environment()`, plus the variables read from a Secret (its stand-in value)."""
    secrets = tenant_secrets()
    from_secrets = [v for v in container.get("env", []) if "secretKeyRef" in v.get("valueFrom", {})]
    plain = {**container, "env": [v for v in container.get("env", []) if v not in from_secrets]}
    env = environment(pod, plain)
    for var in from_secrets:
        ref = var["valueFrom"]["secretKeyRef"]
        env[var["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def parse_line(parser: Parse, pod: Resource, container: Resource) -> click.Context:
    """The context of the container's command line, a group's subcommand resolved (as
    `outbox-farm fleet migrate` runs `migrate` in the context of `fleet`)."""
    env = pod_environment(pod, container)
    line = [expand(arg, env) for arg in argv(container, *image_command())]
    ctx = parser(line, env)
    if isinstance(ctx.command, click.Group):
        name, *rest = line[2:]
        command = ctx.command.get_command(ctx, name)
        if command is None:
            raise click.UsageError(f"no such command {line[1]} {name!r}")
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def command_path(ctx: click.Context) -> str:
    return ctx.command_path.removeprefix("outbox-farm ")


def mounted_databases_file(pod: Resource, container: Resource, configmaps: set[str]) -> str:
    """The name of the ConfigMap the container reads DATABASES_FILE from, read-only."""
    [mount] = [
        m for m in container["volumeMounts"] if DATABASES_FILE.is_relative_to(m["mountPath"])
    ]
    assert mount.get("readOnly") is True
    assert "subPath" not in mount, "the kubelet would never update the file"
    volume = {v["name"]: v for v in pod["volumes"]}[mount["name"]]["configMap"]
    relative = str(DATABASES_FILE.relative_to(mount["mountPath"]))
    assert relative in {item["path"] for item in volume["items"]}
    assert volume["name"] in configmaps, "the ConfigMap is applied with what mounts it"
    return str(volume["name"])


def databases_toml(built: list[Resource]) -> str:
    [configmap] = [r for r in built if r["kind"] == "ConfigMap"]
    return str(configmap["data"][DATABASES_FILE.name])


def farm(built: list[Resource]) -> tuple[Resource, Resource]:
    pod = the(built, "Deployment", "outbox-farm")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod, container


def job_containers(built: list[Resource]) -> Iterator[tuple[Resource, Resource]]:
    pod = the(built, "Job", "outbox-farm-migrate")["spec"]["template"]["spec"]
    for container in containers(the(built, "Job", "outbox-farm-migrate")):
        yield pod, container


def triggers(built: list[Resource]) -> dict[str, Resource]:
    scaled = the(built, "ScaledObject", "outbox-farm")["spec"]
    return {t["name"]: t for t in scaled["triggers"]}


# -- the compositions ----------------------------------------------------------------------------


def test_the_fleet_overlay_is_full_with_the_fleet_and_its_databases_file(tmp_path: Path) -> None:
    fleet = build(FLEET)
    assert fleet == build(overlay(tmp_path / "mine", "fleet", "fleet-keda", "prometheus-operator"))
    assert ids(fleet) == ids(build(FULL)) | {("ConfigMap", "outbox-farm-databases")}
    for resource in fleet:
        validate(resource)
    # One image, the base's; the ScaledObject still owns the replica count.
    [image] = {c["image"] for r in fleet for c in containers(r)}
    assert image == {c["image"] for r in build(BASE_MIGRATE) for c in containers(r)}.pop()
    assert "replicas" not in the(fleet, "Deployment", "outbox-farm")["spec"]


def test_each_fleet_composition_validates(tmp_path: Path) -> None:
    for number, components in enumerate(
        [("fleet",), ("fleet", "fleet-keda"), ("fleet", "prometheus-operator"), ("fleet-keda",)]
    ):
        built = build(overlay(tmp_path / f"overlay{number}", *components))
        assert ("Deployment", "outbox-farm") in ids(built)
        for resource in built:
            validate(resource)
    migrate = build(FLEET_MIGRATE)
    assert ids(migrate) == {("Job", "outbox-farm-migrate"), ("ConfigMap", "outbox-farm-databases")}
    for resource in migrate:
        validate(resource)


def test_the_fleet_changes_only_the_farm_s_app_environment_and_databases_file(
    tmp_path: Path,
) -> None:
    base = build(overlay(tmp_path / "base"))
    fleet = build(overlay(tmp_path / "fleet", "fleet"))
    assert ids(fleet) == ids(base) | {("ConfigMap", "outbox-farm-databases")}
    for kind, name in ids(base) - {("Deployment", "outbox-farm")}:
        assert the(fleet, kind, name) == the(base, kind, name)
    before, after = farm(base), farm(fleet)
    assert before[1]["args"] == ["start", "app:farm"]
    assert after[1]["args"] == ["start"]  # the app: OUTBOX_FARM_APP
    names = {var["name"] for var in before[1]["env"]}
    added = [var["name"] for var in after[1]["env"] if var["name"] not in names]
    assert added == ["OUTBOX_FARM_APP", "TENANT_A_PASSWORD", "TENANT_B_PASSWORD"]
    for pod, container in (before, after):
        pod["volumes"] = [v for v in pod["volumes"] if "configMap" not in v]
        container["volumeMounts"] = [
            m for m in container["volumeMounts"] if m["mountPath"] != str(DATABASES_FILE.parent)
        ]
        container["env"] = [var for var in container["env"] if var["name"] in names]
        del container["args"]
    assert after == before


def test_keda_for_a_fleet_is_keda_with_other_triggers_and_refuses_keda_beside_it(
    tmp_path: Path,
) -> None:
    keda = build(overlay(tmp_path / "keda", "keda"))
    fleet_keda = build(overlay(tmp_path / "fleet-keda", "fleet-keda"))
    assert ids(fleet_keda) == ids(keda)
    expected = copy.deepcopy(the(keda, "ScaledObject", "outbox-farm"))
    expected["spec"]["triggers"] = the(fleet_keda, "ScaledObject", "outbox-farm")["spec"][
        "triggers"
    ]
    assert the(fleet_keda, "ScaledObject", "outbox-farm") == expected
    assert set(triggers(fleet_keda)) == {"databases", "backlog"}
    # fleet-keda replaces keda: listing both adds keda's resources twice, which kustomize
    # refuses ("may not add resource with an already registered id"), as this build does.
    with pytest.raises(KustomizeError):
        build(overlay(tmp_path / "both", "keda", "fleet-keda"))


# -- the farm's pods and the migration Job -------------------------------------------------------


def test_the_farm_starts_the_fleet_on_the_home_dsn_reading_the_mounted_file(
    parse: Parse,  # noqa: F811
) -> None:
    built = build(FLEET)
    pod, container = farm(built)
    ctx = parse_line(parse, pod, container)
    assert command_path(ctx) == "start"
    assert ctx.params["app"] == APP
    # The home DSN: the base's Secret file, as for the single farm.
    dsn_file = Path(ctx.params["dsn_file"])
    mounts = {Path(m["mountPath"]): m["name"] for m in container["volumeMounts"]}
    secret = {v["name"]: v for v in pod["volumes"]}[mounts[dsn_file.parent]]["secret"]
    assert secret["secretName"] == "outbox-farm-dsn"
    configmaps = {r["metadata"]["name"] for r in built if r["kind"] == "ConfigMap"}
    assert mounted_databases_file(pod, container, configmaps) == "outbox-farm-databases"


def test_the_migration_job_runs_fleet_migrate_then_fleet_check(parse: Parse) -> None:  # noqa: F811
    built = build(FLEET_MIGRATE)
    base = {c["name"]: c for _, c in job_containers(build(BASE_MIGRATE))}
    configmaps = {r["metadata"]["name"] for r in built if r["kind"] == "ConfigMap"}
    run = {}
    for pod, container in job_containers(built):
        ctx = parse_line(parse, pod, container)
        assert ctx.params["app"] == APP
        mounted_databases_file(pod, container, configmaps)
        # Each with the DSN file the single farm's Job gives that container.
        assert (
            ctx.params["dsn_file"]
            == pod_environment(pod, base[container["name"]])["OUTBOX_FARM_DSN_FILE"]
        )
        run[container["name"]] = (command_path(ctx), ctx.params["database"])
    assert run == {"migrate": ("fleet migrate", "all"), "check": ("fleet check", "all")}
    # The init container runs first: a database failing its migration fails the Job unchecked.
    job = the(built, "Job", "outbox-farm-migrate")["spec"]["template"]["spec"]
    assert [c["name"] for c in job["initContainers"]] == ["migrate"]


def test_the_databases_file_reads_as_two_databases_with_passwords_from_the_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = tmp_path / DATABASES_FILE.name
    file.write_text(databases_toml(build(FLEET)))
    referenced = set(re.findall(r"\$\{(\w+)\}", file.read_text()))
    for name in referenced:
        monkeypatch.delenv(name, raising=False)
    # The control: without the variables, each database is left out, naming its variable.
    bare = read_file(file)
    assert bare.databases == {}
    assert sorted(bare.problems) == ["tenant-a", "tenant-b"]
    assert all(" is not set" in problem for problem in bare.problems.values())
    migrate = list(job_containers(build(FLEET_MIGRATE)))
    assert databases_toml(build(FLEET_MIGRATE)) == file.read_text()
    for pod, container in [farm(build(FLEET)), *migrate]:
        env = pod_environment(pod, container)
        assert referenced <= set(env), container["name"]
        with monkeypatch.context() as patched:
            for name in referenced:
                patched.setenv(name, env[name])
            listing = read_file(file)
        assert listing.problems == {}
        assert set(listing.databases) == {"tenant-a", "tenant-b"}
        passwords = {
            name: dict(psycopg.conninfo.conninfo_to_dict(dsn))["password"]
            for name, dsn in listing.databases.items()
        }
        assert passwords == {
            "tenant-a": "pw-tenant-a-password",
            "tenant-b": "pw-tenant-b-password",
        }


# -- KEDA ------------------------------------------------------------------------------------------


def test_the_scaled_object_scales_a_fleet_on_its_size_and_its_backlog(
    parse: Parse,  # noqa: F811
) -> None:
    built = build(FLEET)
    scaled = the(built, "ScaledObject", "outbox-farm")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "outbox-farm"
    found = triggers(built)
    size = found["databases"]
    assert size["type"] == "postgresql"
    assert size["metricType"] == "AverageValue", "pods = ceil(databases / target)"
    assert size["authenticationRef"]["name"] in {
        r["metadata"]["name"] for r in built if r["kind"] == "TriggerAuthentication"
    }
    # Databases per pod: at least one per worker process, and as the comment computes it.
    pod, container = farm(built)
    procs = parse_line(parse, pod, container).params["procs"]
    target = int(size["metadata"]["targetQueryValue"])
    text = (FLEET_KEDA / "kustomization.yaml").read_text()
    [(per_pod, stated_procs, max_databases)] = re.findall(
        r"ceil\(databases / (\d+)\).*?\((\d+) x (\d+) here\)", " ".join(text.split())
    )
    assert int(per_pod) == target == int(stated_procs) * int(max_databases)
    assert int(stated_procs) == procs

    backlog = found["backlog"]
    assert (backlog["type"], backlog["metricType"]) == ("prometheus", "AverageValue")
    query = " ".join(backlog["metadata"]["query"].split())
    metrics = fleet_metrics()
    # Each database's count, from the pods serving it now (a process that let it go leaves its
    # last count in its metric file, and 0 served).
    assert re.findall(r"outbox_farm_\w+", query) == [metrics.backlog._name, metrics.served._name]
    assert re.findall(r'job="([^"]+)"', query) == [PROMETHEUS_JOB] * 2
    assert re.fullmatch(
        r"sum\(outbox_farm_database_backlog\{[^}]*\} and on\(instance, database\) "
        r"\(outbox_farm_database_served\{[^}]*\} > 0\)\)",
        query,
    )


def test_keda_s_role_for_a_fleet_counts_the_catalog_and_can_change_nothing(
    empty_dsn: str,
) -> None:
    query = triggers(build(FLEET))["databases"]["metadata"]["query"]
    script = (FLEET_KEDA / "keda-role.sql").read_text()
    [table] = re.findall(r"GRANT SELECT ON TABLE public\.(\w+)", script)
    assert re.fullmatch(rf"SELECT count\(\*\) FROM {table}", query)
    role = f"outbox_farm_keda_{uuid.uuid4().hex[:8]}"
    assert script.count("outbox_farm_keda") >= 4  # every statement names the role
    with psycopg.connect(empty_dsn, autocommit=True) as owner:
        name = sql.Identifier(table)
        owner.execute(sql.SQL("CREATE TABLE {} (name text PRIMARY KEY, dsn text)").format(name))
        owner.execute(
            sql.SQL(
                "INSERT INTO {} SELECT 't' || n, 'dbname=t' || n FROM generate_series(1, 3) n"
            ).format(name)
        )
        owner.execute(script.replace("outbox_farm_keda", role))
        try:
            with psycopg.connect(make_conninfo(empty_dsn, user=role), autocommit=True) as keda:
                [(count,)] = keda.execute(query).fetchall()
                assert count == 3
                with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                    keda.execute(sql.SQL("DELETE FROM {}").format(name))
        finally:
            owner.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            owner.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
