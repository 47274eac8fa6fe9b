"""The sidecar image. allocwatch publishes none, so the manifests name one placeholder under the
reserved `.invalid` domain (RFC 2606), which never resolves and which no one can register and
fill; its name and tag are set in one place, deploy/components/sidecar-image, and a user's
`images:` entry (what `kustomize edit set image` writes) reaches every copy of it, the admission
policies' included. The docs' build, push and set commands name the same image."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support.deploy import (
    DEPLOY,
    REPO,
    SIDECAR,
    kustomization_dirs,
    kustomize_build,
    sidecar_image,
    sidecar_image_entry,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")

PLACEHOLDER = "allocwatch.invalid/allocwatch-sidecar"
# A user's image, as the docs name it (example.com is reserved too).
THEIRS_NAME = "registry.example.com/allocwatch/allocwatch-sidecar"
DIGEST = "sha256:" + "ab" * 32
THEIRS = f"{THEIRS_NAME}@{DIGEST}"
OVERRIDE = {"name": PLACEHOLDER, "newName": THEIRS_NAME, "digest": DIGEST}
# The kustomizations whose output carries the image (the MutatingAdmissionPolicy reads the copy
# that deploy/base puts in each namespace).
HOLDERS = {"deploy/base", "deploy/admission/kyverno", "deploy/examples/job",
           "deploy/examples/job-legacy-sidecar", "deploy/examples/pytorchjob",
           "deploy/examples/jobset"}
# `kustomize edit set image NAME=NEW@DIGEST`, its argument on the next line after a `\` or not.
SET_IMAGE = re.compile(r"kustomize edit set image (?:\\\n\s*)?(\S+?)=(\S+?)@(sha256:\S+?)\)?$",
                       re.M)
DOCKER_BUILD = re.compile(r"docker build -f deploy/image/Dockerfile -t (\S+) \.$", re.M)
DOCKER_PUSH = re.compile(r"docker push (\S+)$", re.M)
# An image reference under a registry host (a name with a dot) that ends in the sidecar's name.
REGISTRY_REFERENCE = re.compile(r"\b([a-z0-9-]+(?:\.[a-z0-9-]+)+(?::\d+)?)/(?:[\w.-]+/)*"
                                + SIDECAR + r"\b")


def relative(directory: Path) -> str:
    return str(directory.relative_to(REPO))


def image_fields(node: object) -> Iterator[str]:
    """Every `image:` value anywhere in the rendered objects (pod specs, pod templates inside
    custom resources, the Kyverno policy's patch)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str):
                yield value
            else:
                yield from image_fields(value)
    elif isinstance(node, list):
        for item in node:
            yield from image_fields(item)


def sidecar_images(resources: list[dict]) -> list[str]:
    return [image for image in image_fields(resources) if SIDECAR in image]


def build_with_override(directory: Path, where: Path) -> list[dict]:
    """`directory` as a user's overlay lists it, with their `images:` entry."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(directory, where)], "images": [OVERRIDE]}))
    return kustomize_build(where)


def project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_placeholder_is_under_a_reserved_domain_and_carries_the_projects_version() -> None:
    entry = sidecar_image_entry()
    assert entry == {"name": PLACEHOLDER, "newTag": project_version()}
    assert entry["name"].split("/")[0].endswith(".invalid")
    assert sidecar_image() == f"{PLACEHOLDER}:{project_version()}"


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=relative)
def test_every_kustomization_renders_the_placeholder_unless_overridden(directory: Path) -> None:
    images = sidecar_images(kustomize_build(directory))
    if relative(directory) in HOLDERS:
        assert images, f"{relative(directory)} renders no sidecar image"
        assert set(images) == {sidecar_image()}, images
    else:
        assert images == []


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=relative)
def test_a_users_images_entry_reaches_every_copy(directory: Path, tmp_path: Path) -> None:
    before = sidecar_images(kustomize_build(directory))
    resources = build_with_override(directory, tmp_path / "overlay")
    assert sidecar_images(resources) == [THEIRS] * len(before)
    # Nor is the placeholder left anywhere else (a string the image transformer cannot see).
    assert PLACEHOLDER not in yaml.safe_dump_all(resources)


def test_the_component_on_a_users_own_job_takes_their_image(tmp_path: Path) -> None:
    """docs/deploy.md, "The kustomize Component": deploy/base, the user's Job, the Component
    and their `images:` entry. The Job's sidecar and the namespace's PodTemplate (the
    MutatingAdmissionPolicy's source) both get it."""
    shutil.copy(DEPLOY / "examples/job/job.yaml", tmp_path / "my-job.yaml")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "namespace": "training",
        "resources": [os.path.relpath(DEPLOY / "base", tmp_path), "my-job.yaml"],
        "components": [os.path.relpath(DEPLOY / "components/allocwatch", tmp_path)],
        "images": [OVERRIDE]}))
    resources = kustomize_build(tmp_path)
    by_kind = {r["kind"]: r for r in resources}
    [job_sidecar] = [c for c in by_kind["Job"]["spec"]["template"]["spec"]["initContainers"]
                     if c["name"] == SIDECAR]
    assert job_sidecar["image"] == THEIRS
    assert sidecar_images([by_kind["PodTemplate"]]) == [THEIRS]


def test_the_mutating_admission_policy_reads_the_image_deploy_base_names() -> None:
    """Kustomize cannot rewrite an image inside CEL: the policy takes it from its parameter, the
    PodTemplate of deploy/base in the admitted pod's namespace, whose image `images:` sets
    (test_a_users_images_entry_reaches_every_copy[deploy/base])."""
    resources = kustomize_build(DEPLOY / "admission/mutating-admission-policy")
    [policy] = [r for r in resources if r["kind"] == "MutatingAdmissionPolicy"]
    [binding] = [r for r in resources if r["kind"] == "MutatingAdmissionPolicyBinding"]
    [template] = [r for r in kustomize_build(DEPLOY / "base") if r["kind"] == "PodTemplate"]

    assert policy["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "PodTemplate"}
    # No namespace: the pod's own. Missing there, failurePolicy Ignore: no sidecar, no refusal.
    assert binding["spec"]["paramRef"] == {"name": template["metadata"]["name"],
                                           "parameterNotFoundAction": "Deny"}
    assert policy["spec"]["failurePolicy"] == "Ignore"
    # A per-namespace parameter needs a namespaced object under admission: pods only.
    assert [rule["resources"] for rule in
            policy["spec"]["matchConstraints"]["resourceRules"]] == [["pods"]]
    expression = policy["spec"]["mutations"][0]["applyConfiguration"]["expression"]
    assert "image: params.template.spec.containers[0].image," in expression
    assert SIDECAR + ":" not in expression and ".invalid" not in expression
    containers = template["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == [SIDECAR]
    assert containers[0]["image"] == sidecar_image()


def documents_with_commands() -> dict[str, str]:
    texts = {"README.md": (REPO / "README.md").read_text(),
             "docs/deploy.md": (REPO / "docs/deploy.md").read_text(),
             "deploy/image/Dockerfile": (DEPLOY / "image/Dockerfile").read_text()}
    for kustomization in sorted(DEPLOY.rglob("kustomization.yaml")):
        texts[str(kustomization.relative_to(REPO))] = kustomization.read_text()
    return texts


def test_the_docs_build_push_and_set_one_image() -> None:
    """Every `docker build`, `docker push` and `kustomize edit set image` the docs and the
    manifests' comments show names the placeholder as the image to replace, and the same image
    of the user's, tagged with the project's version where it is built and pushed."""
    built, pushed, set_to, setting = set(), set(), set(), set()
    for where, text in documents_with_commands().items():
        text = re.sub(r"^\s*#\s?", "", text, flags=re.M)  # commands in comments count too
        built |= set(DOCKER_BUILD.findall(text))
        pushed |= set(DOCKER_PUSH.findall(text))
        for name, new_name, digest in SET_IMAGE.findall(text):
            assert name == PLACEHOLDER, f"{where}: `set image` replaces {name}"
            set_to.add((new_name, digest))
            setting.add(where)
    assert {"README.md", "docs/deploy.md", "deploy/components/sidecar-image/kustomization.yaml",
            "deploy/examples/job/kustomization.yaml"} <= setting, setting
    tagged = f"{THEIRS_NAME}:{project_version()}"
    assert built == {tagged} and pushed == {tagged}
    assert set_to == {(THEIRS_NAME, "sha256:<digest>")}


@pytest.mark.parametrize("document", ["README.md", "docs/deploy.md"])
def test_the_docs_steps_set_the_image_every_copy_takes(document: str, tmp_path: Path) -> None:
    """The README's and the deploy doc's steps, in a copy of deploy/: `(cd deploy/examples/job
    && kustomize edit set image NAME=NEW@DIGEST)`, as the entry kustomize writes for it (name,
    newName, digest: its documented output; kubectl has no `edit`), then the example's build."""
    text = (REPO / document).read_text()
    found = re.search(r"\(cd (deploy/\S+) && " + SET_IMAGE.pattern, text, re.M)
    assert found, f"{document} no longer sets the image in the example it applies"
    directory, name, new_name, _ = found.groups()
    assert f"kubectl apply -k {directory}" in text
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    kustomization = copy / Path(directory).relative_to("deploy") / "kustomization.yaml"
    written = yaml.safe_load(kustomization.read_text())
    written["images"] = [{"digest": DIGEST, "name": name, "newName": new_name}]
    kustomization.write_text(yaml.safe_dump(written))
    images = sidecar_images(kustomize_build(kustomization.parent))
    assert images and set(images) == {f"{new_name}@{DIGEST}"}


def repository_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True, check=True)
    return [REPO / name for name in filter(None, listed.stdout.decode().split("\0"))
            if (REPO / name).is_file()]


def test_no_file_names_a_sidecar_image_someone_else_could_publish() -> None:
    """Outside the reserved domains (`.invalid`, the docs' example.com), a sidecar image under a
    registry host is one that someone could register and fill, as the organisation the
    manifests once named could be."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to list the repository's files")
    allowed = {PLACEHOLDER.split("/")[0], THEIRS_NAME.split("/")[0]}
    old = "ghcr.io/" + "allocwatch"  # split, so that this file does not name it either
    offending = []
    for path in repository_files():
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode(errors="replace")
        if old in text:
            offending.append(f"{path.relative_to(REPO)}: {old}")
        offending += [f"{path.relative_to(REPO)}: {m.group(0)}"
                      for m in REGISTRY_REFERENCE.finditer(text) if m.group(1) not in allowed]
    assert offending == []
