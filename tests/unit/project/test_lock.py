"""The lock files (locks/, made by scripts/lock.sh) against the pyproject files they lock.

Each install set is a lock of exact versions with hashes, installed with --require-hashes and
then the project's own distributions with --no-deps, so the lock alone decides what is there:
- locks/product.txt: the product's dependencies (both images; the engine-sim image adds only
  engine-sim/ with --no-deps, so its dependencies must be in the product's lock too);
- locks/dev.txt: .venv's (the product with its dev extra, engine-sim/, testbed/, sim/);
- locks/build.txt: the build backend the pyprojects name, and pip (the installer).
A lock must satisfy every requirement its pyprojects declare (version specifier, extras and the
markers that apply here), hold nothing that no requirement reaches, and hash every line.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from importlib.metadata import requires as declared_requirements
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[3]
LOCKS = REPO / "locks"
OURS = {"prfaas", "prfaas-engine-sim", "prfaas-testbed", "prfaas-sim"}
"""Installed from the checkout with --no-deps, never from a lock."""
INSTALLER = [Requirement("pip")]
"""In the build lock though no pyproject names it: setup.sh and the images install with this pip."""
PIN = re.compile(r"(?P<name>[a-z0-9][a-z0-9._-]*)==(?P<version>\S+)")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Pin:
    name: str
    version: Version
    hashes: frozenset[str]


def read_lock(text: str) -> dict[str, Pin]:
    """Every requirement of a lock; a line that is not `name==version` with only hashes fails."""
    pins: dict[str, Pin] = {}
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, *options = line.split()
        pin = PIN.fullmatch(requirement)
        assert pin, f"not an exact pin: {line}"
        assert all(HASH.fullmatch(option) for option in options), f"an option other than a hash: {line}"
        assert options, f"no hash: {requirement}"
        name = canonicalize_name(pin["name"])
        assert name not in pins, f"pinned twice: {name}"
        pins[name] = Pin(name, Version(pin["version"]), frozenset(options))
    return pins


def project(path: str) -> dict[str, Any]:
    with (REPO / path).open("rb") as file:
        data: dict[str, Any] = tomllib.load(file)
        return data


def dependencies(path: str, *extras: str) -> list[Requirement]:
    meta = project(path)["project"]
    found = [Requirement(r) for r in meta["dependencies"]]
    for extra in extras:
        found += [Requirement(r) for r in meta["optional-dependencies"][extra]]
    return found


PYPROJECTS = ("pyproject.toml", "engine-sim/pyproject.toml", "testbed/pyproject.toml", "sim/pyproject.toml")
PRODUCT = dependencies("pyproject.toml")
ENGINE_SIM = dependencies("engine-sim/pyproject.toml")
DEV = (
    dependencies("pyproject.toml", "dev")
    + ENGINE_SIM
    + dependencies("testbed/pyproject.toml")
    + dependencies("sim/pyproject.toml")
)
BUILD = [Requirement(r) for path in PYPROJECTS for r in project(path)["build-system"]["requires"]] + INSTALLER
INSTALL_SETS = {
    "product image": ("product.txt", PRODUCT),
    "engine-sim image": ("product.txt", PRODUCT + ENGINE_SIM),
    "dev venv": ("dev.txt", DEV),
    "build tools": ("build.txt", BUILD),
}
ENVIRONMENT = {key: str(value) for key, value in default_environment().items()}


def lock(file: str) -> dict[str, Pin]:
    return read_lock((LOCKS / file).read_text())


def installed(name: str) -> Version | None:
    try:
        return Version(version(name))
    except PackageNotFoundError:
        return None


def applies(requirement: Requirement, extras: set[str]) -> bool:
    """Whether a requirement's marker holds here (CPython 3.11 on Linux) for any of the extras asked."""
    marker = requirement.marker
    return marker is None or any(marker.evaluate({**ENVIRONMENT, "extra": e}) for e in extras | {""})


def unmet(requirements: list[Requirement], pins: dict[str, Pin]) -> list[str]:
    """The requirements that apply here and that the pins do not satisfy."""
    return [
        f"{r} (locked: {pins[name].version if name in pins else 'nothing'})"
        for r in requirements
        if (name := canonicalize_name(r.name)) not in OURS
        and applies(r, set())
        and (name not in pins or not r.specifier.contains(pins[name].version, prereleases=True))
    ]


def reached(roots: list[Requirement]) -> set[str]:
    """Every distribution the roots need, through the installed metadata, extras and markers applied.

    The installed versions are the locked ones (test_this_venv_is_the_locks), so the metadata
    read here is that of the pinned releases.
    """
    seen: set[str] = set()
    asked: dict[str, set[str]] = {}
    pending = [r for r in roots if applies(r, set())]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        extras = set(requirement.extras)
        if name in seen and extras <= asked[name]:
            continue
        seen.add(name)
        asked[name] = asked.get(name, set()) | extras
        pending += [r for r in map(Requirement, declared_requirements(name) or []) if applies(r, asked[name])]
    return seen - OURS


def test_every_lock_line_is_an_exact_pin_with_hashes() -> None:
    for file in ("product.txt", "dev.txt", "build.txt"):
        pins = lock(file)
        assert pins, file
        assert all(pin.hashes for pin in pins.values())


def test_a_lock_line_without_a_hash_or_with_a_range_is_refused() -> None:
    with pytest.raises(AssertionError, match="no hash"):
        read_lock("aiohttp==3.14.5\n")
    with pytest.raises(AssertionError, match="not an exact pin"):
        read_lock("aiohttp>=3.10 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(AssertionError, match="an option other than a hash"):
        read_lock("aiohttp==3.14.5 --index-url=https://example.invalid\n")


@pytest.mark.parametrize("install_set", INSTALL_SETS)
def test_the_lock_satisfies_every_requirement_the_pyprojects_declare(install_set: str) -> None:
    file, requirements = INSTALL_SETS[install_set]
    assert unmet(requirements, lock(file)) == [], f"run scripts/lock.sh ({install_set}: locks/{file})"


def test_a_pin_outside_a_declared_range_is_unmet() -> None:
    pins = {"numpy": Pin("numpy", Version("1.26.4"), frozenset({"--hash=sha256:" + "0" * 64}))}
    assert unmet([Requirement("numpy>=2.0")], pins) == ["numpy>=2.0 (locked: 1.26.4)"]
    assert unmet([Requirement("scipy")], pins) == ["scipy (locked: nothing)"]
    assert unmet([Requirement("pywin32; sys_platform == 'win32'"), Requirement("prfaas==0.1.0")], pins) == []


def test_this_venv_is_the_locks() -> None:
    """scripts/setup.sh installs .venv from the dev and build locks; the checks below read its metadata."""
    pins = lock("dev.txt") | lock("build.txt")
    differ = {n: (str(p.version), installed(n)) for n, p in pins.items() if installed(n) != p.version}
    assert differ == {}, "run scripts/setup.sh"


@pytest.mark.parametrize("file", ["product.txt", "dev.txt", "build.txt"])
def test_every_locked_distribution_is_needed_and_nothing_needed_is_missing(file: str) -> None:
    roots = [r for name, (f, requirements) in INSTALL_SETS.items() if f == file for r in requirements]
    assert set(lock(file)) == reached(roots)


def test_a_distribution_in_two_locks_has_one_pin() -> None:
    """The dev venv tests the product's pins, and the build tools share the dev venv."""
    dev = lock("dev.txt")
    for file in ("product.txt", "build.txt"):
        other = lock(file)
        differ = {
            n: (str(other[n].version), str(dev[n].version))
            for n in other.keys() & dev.keys()
            if other[n] != dev[n]
        }
        assert differ == {}, f"locks/{file} and locks/dev.txt pin these differently: run scripts/lock.sh"
    assert lock("product.txt").keys() - dev.keys() == set()
