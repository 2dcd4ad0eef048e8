"""`python -m prfaas_operator.crd_apply`: install or upgrade this project's CRDs in a cluster.

Helm installs a chart's crds/ on the first install only and never upgrades them. The chart's
pre-install/pre-upgrade hook Job runs this module from the product image instead, so `helm
upgrade` (and a GitOps tool that renders the chart's hooks) brings the CRD to the version the
operator needs before the operator's new Deployment rolls out.

Each CRD (crd.KINDS: PrfaasDeployment, PrfaasPool, PrfaasPoolClaim) is generated in-process
from this image's models (`crd.crd_manifest(kind)`, the same text
the repository's crds/ files hold: a unit test fails on drift), so the image and the CRD it
needs never disagree and no YAML file has to ship in the image.

It is a server-side apply with field manager `prfaas-operator-crd`, forced: the CRD belongs to
this project, so fields written before by someone else (Helm's install of crds/, a `kubectl
apply`) are taken over rather than reported as conflicts. `spec.versions` is an atomic list in
the CRD's API, so the schema, the printer columns and the subresources are replaced whole: a
property or a validation rule removed from the models is removed from the cluster too. Then it
waits until the CRD is Established (served), or says why not (NamesAccepted=False names the
conflict).

    python -m prfaas_operator.crd_apply                 # apply, wait up to 60 s for Established
    python -m prfaas_operator.crd_apply --dry-run       # server-side dry run: what would change
    python -m prfaas_operator.crd_apply --timeout 120

The cluster is the in-cluster ServiceAccount's, else $KUBECONFIG's current context. Exit codes:
0 applied (or already current) and Established; 1 the apiserver refused or did not answer, or
the CRD did not become Established in time; 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

import httpx2
from lightkube import ApiError, Client, ConfigError
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.types import PatchType

from prfaas_operator import crd

FIELD_MANAGER = "prfaas-operator-crd"
DEFAULT_TIMEOUT_SECONDS = 60.0
POLL_SECONDS = 1.0
CREATED, UPDATED, UNCHANGED = "created", "updated", "unchanged"


# ---- pure: what happened, what to say ------------------------------------------------------------


def change(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> str:
    """created, updated or unchanged: the apiserver bumps metadata.generation on every spec change."""
    if before is None:
        return CREATED
    if before.get("metadata", {}).get("generation") != after.get("metadata", {}).get("generation"):
        return UPDATED
    return UNCHANGED


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in obj.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return None


def not_established(obj: Mapping[str, Any]) -> str | None:
    """None once the CRD is Established; else why not, in the apiserver's own words where it gave any."""
    established = _condition(obj, "Established")
    if established is not None and established.get("status") == "True":
        return None
    names = _condition(obj, "NamesAccepted")
    if names is not None and names.get("status") == "False":
        return f"names not accepted ({names.get('reason', '')}): {names.get('message', '')}"
    if established is None:
        return "no Established condition yet"
    return f"Established={established.get('status')} ({established.get('reason', '')}): {established.get('message', '')}"


def _properties(node: Mapping[str, Any], path: str) -> Iterator[str]:
    for name, child in (node.get("properties") or {}).items():
        here = f"{path}.{name}"
        yield here
        yield from _properties(child, here)
    if isinstance(node.get("items"), Mapping):
        yield from _properties(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), Mapping):
        yield from _properties(node["additionalProperties"], f"{path}.*")


def _schema_fields(manifest: Mapping[str, Any]) -> dict[str, set[str]]:
    fields = {}
    for version in manifest.get("spec", {}).get("versions") or []:
        schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
        fields[version.get("name", "?")] = set(_properties(schema, ""))
    return fields


def removed_fields(live: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """Schema fields the live CRD has and the desired one drops, as `version:.spec.path`.

    Not an error (the models may drop a field on purpose) but worth a warning: an older image
    applying its CRD over a newer one (a downgrade) makes the apiserver prune those fields from
    every object it writes from then on.
    """
    wanted = _schema_fields(desired)
    dropped = []
    for version, paths in _schema_fields(live).items():
        dropped += [f"{version}:{path}" for path in sorted(paths - wanted.get(version, set()))]
    return dropped


def refusal(code: int, message: str) -> str:
    """One line on an apiserver refusal, with what to do about the usual ones."""
    if code == 403:
        names = ", ".join(f"customresourcedefinitions/{kind.crd_name}" for kind in crd.KINDS)
        return f"forbidden: {message} (the hook's ClusterRole grants get, create and patch on {names}; was rbac.create=false?)"
    if code == 401:
        return f"the apiserver rejected the credentials (HTTP 401: {message})"
    if code == 422:
        return f"the apiserver rejected the CRD: {message}"
    return f"HTTP {code}: {message}"


# ---- the cluster ----------------------------------------------------------------------------------


def _get(client: Client, name: str) -> dict[str, Any] | None:
    try:
        found = client.get(CustomResourceDefinition, name)
    except ApiError as exc:
        if exc.status.code == 404:
            return None
        raise
    as_dict: dict[str, Any] = found.to_dict()
    return as_dict


def apply(client: Client, manifest: Mapping[str, Any], *, dry_run: bool) -> dict[str, Any]:
    applied = client.patch(
        CustomResourceDefinition,
        manifest["metadata"]["name"],
        dict(manifest),
        patch_type=PatchType.APPLY,
        field_manager=FIELD_MANAGER,
        force=True,
        dry_run=dry_run,
    )
    as_dict: dict[str, Any] = applied.to_dict()
    return as_dict


def wait_established(client: Client, name: str, timeout: float, out: TextIO) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        live = _get(client, name)
        why = "the CRD is gone" if live is None else not_established(live)
        if why is None:
            return True
        if time.monotonic() >= deadline:
            print(f"{name}: not Established after {timeout:g} s: {why}", file=out)
            return False
        time.sleep(POLL_SECONDS)


def run(client: Client, *, dry_run: bool, timeout: float, out: TextIO, err: TextIO) -> int:
    """Every CRD applied in turn (PrfaasDeployment's first); the first that fails ends the run."""
    for kind in crd.KINDS:
        if not _run_one(client, kind, dry_run=dry_run, timeout=timeout, out=out, err=err):
            return 1
    return 0


def _run_one(
    client: Client, kind: crd.Kind, *, dry_run: bool, timeout: float, out: TextIO, err: TextIO
) -> bool:
    name = kind.crd_name
    try:
        return _apply_one(
            client, name, crd.crd_manifest(kind), dry_run=dry_run, timeout=timeout, out=out, err=err
        )
    except ApiError as exc:
        code = exc.status.code or exc.response.status_code
        print(f"{name}: {refusal(code, exc.status.message or str(exc))}", file=err)
    except httpx2.TransportError as exc:
        print(f"{name}: cannot reach the apiserver: {exc or type(exc).__name__}", file=err)
    return False


def _apply_one(
    client: Client,
    name: str,
    desired: dict[str, Any],
    *,
    dry_run: bool,
    timeout: float,
    out: TextIO,
    err: TextIO,
) -> bool:
    before = _get(client, name)
    if before is not None:
        for field in removed_fields(before, desired):
            print(f"warning: {name}: this CRD drops {field}; objects written from now on lose it", file=err)
    after = apply(client, desired, dry_run=dry_run)
    what = change(before, after)
    generation = after.get("metadata", {}).get("generation")
    suffix = " (server-side dry run: nothing was written)" if dry_run else ""
    print(f"{name}: {what}, generation {generation}, field manager {FIELD_MANAGER}{suffix}", file=out)
    if dry_run:
        return True
    if not wait_established(client, name, timeout, err):
        return False
    print(f"{name}: Established", file=out)
    return True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m prfaas_operator.crd_apply", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dry-run", action="store_true", help="server-side dry run: change nothing")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"how long to wait for the CRD to be Established (default {DEFAULT_TIMEOUT_SECONDS:g})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.timeout >= 0:
        parser.error("--timeout must be >= 0")
    try:
        client = Client(field_manager=FIELD_MANAGER)
    except ConfigError as exc:
        print(
            f"no cluster to talk to (no in-cluster ServiceAccount, no usable KUBECONFIG): {exc}",
            file=sys.stderr,
        )
        return 1
    return run(client, dry_run=args.dry_run, timeout=args.timeout, out=sys.stdout, err=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
