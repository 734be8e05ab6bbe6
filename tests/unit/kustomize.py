"""The part of `kustomize build` that deploy/'s kustomizations use, for checking them offline.

Fields: `resources` (files, and directories holding a Kustomization), `components` (directories
holding a Component), `patches` (JSON 6902 operations add, remove and replace, inline, with a
`target` naming a group, version, kind and name), and `images` (newName, newTag). Any other
field, patch or operation is refused rather than skipped, so a kustomization cannot use
something this build would silently ignore.

Kustomize's order is kept: a kustomization's own resources first, then each component in turn
(its resources added, its patches and images applied to everything gathered so far), then the
kustomization's own patches and images. So are two of its refusals: a directory loaded from
below it (kustomize: "cycle detected: candidate root contains visited root", which is why an
overlay may not sit under its base), and two resources of one kind and name.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]
API_VERSIONS = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}
FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "images"}
TARGET_FIELDS = {"group", "version", "kind", "name"}
IMAGE_FIELDS = {"name", "newName", "newTag"}


class KustomizeError(Exception):
    """A kustomization `kustomize build` would refuse, or one this build does not cover."""


def build(root: Path) -> list[Resource]:
    """The resources `kustomize build root` prints, in its order."""
    return _kustomization(root.resolve(), "Kustomization", (), [])


def _kustomization(
    root: Path, kind: str, visited: tuple[Path, ...], gathered: list[Resource]
) -> list[Resource]:
    """`gathered` (a component's parent's resources) with the kustomization at `root` applied;
    `visited` are the directories of the kustomizations that led here."""
    for seen in visited:
        if seen.is_relative_to(root):
            raise KustomizeError(f"cycle detected: candidate root {root} contains {seen}")
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    if (spec.get("kind"), spec.get("apiVersion")) != (kind, API_VERSIONS[kind]):
        raise KustomizeError(f"{root}: not a {kind} of {API_VERSIONS[kind]}")
    if unknown := set(spec) - FIELDS:
        raise KustomizeError(f"{root}: fields this build does not apply: {sorted(unknown)}")
    below = (*visited, root)
    resources = list(gathered)
    for entry in spec.get("resources", []):
        path = (root / entry).resolve()
        if path.is_dir():
            resources += _kustomization(path, "Kustomization", below, [])
        else:
            resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for entry in spec.get("components", []):
        resources = _kustomization((root / entry).resolve(), "Component", below, resources)
    for patch in spec.get("patches", []):
        _patch(root, resources, patch)
    for image in spec.get("images", []):
        _image(root, resources, image)
    _refuse_duplicates(root, resources)
    return resources


def _refuse_duplicates(root: Path, resources: list[Resource]) -> None:
    ids = [(r["apiVersion"].split("/")[0], r["kind"], r["metadata"]["name"]) for r in resources]
    if twice := {i for i in ids if ids.count(i) > 1}:
        raise KustomizeError(f"{root}: may not add resource with an already registered id {twice}")


def _selects(target: dict[str, str], resource: Resource) -> bool:
    group, _, version = resource["apiVersion"].rpartition("/")
    found = {"group": group, "version": version, "kind": resource["kind"]}
    found["name"] = resource["metadata"]["name"]
    return all(found[key] == value for key, value in target.items())


def _patch(root: Path, resources: list[Resource], patch: dict[str, Any]) -> None:
    target = patch.get("target", {})
    if set(patch) != {"target", "patch"} or not set(target) <= TARGET_FIELDS:
        raise KustomizeError(f"{root}: only inline JSON 6902 patches with a target: {patch}")
    operations = yaml.safe_load(patch["patch"])
    if not isinstance(operations, list):
        raise KustomizeError(f"{root}: a strategic merge patch; this build applies JSON 6902")
    selected = [r for r in resources if _selects(target, r)]
    if not selected:
        raise KustomizeError(f"{root}: the patch's target {target} matches no resource")
    for resource in selected:
        for operation in operations:
            _operate(root, resource, operation)


def _operate(root: Path, resource: Resource, operation: dict[str, Any]) -> None:
    op, pointer = operation["op"], operation["path"]
    if op not in {"add", "remove", "replace"}:
        raise KustomizeError(f"{root}: JSON 6902 operation {op!r} is not applied here")
    keys = [k.replace("~1", "/").replace("~0", "~") for k in pointer.split("/")[1:]]
    node: Any = resource
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, copy.deepcopy(operation["value"]))
        elif op == "remove":
            del node[index]
        else:
            node[index] = copy.deepcopy(operation["value"])
        return
    if op != "add" and last not in node:
        raise KustomizeError(f"{root}: {op} {pointer}: no such path in {resource['kind']}")
    if op == "remove":
        del node[last]
    else:
        node[last] = copy.deepcopy(operation["value"])


def containers(resource: Resource) -> Iterator[Resource]:
    """The containers (init ones too) of a resource's pod template; none for other kinds."""
    pod = resource.get("spec", {}).get("template", {}).get("spec", {})
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def _image(root: Path, resources: list[Resource], image: dict[str, str]) -> None:
    if not set(image) <= IMAGE_FIELDS or "name" not in image:
        raise KustomizeError(f"{root}: images entry this build does not apply: {image}")
    for resource in resources:
        for container in containers(resource):
            name, tag = container["image"], ""
            if ":" in name.rpartition("/")[2]:  # a tag, not a registry's port
                name, _, tag = name.rpartition(":")
            if name == image["name"]:
                name = image.get("newName", name)
                tag = image.get("newTag", tag)
                container["image"] = f"{name}:{tag}" if tag else name
