"""The previous release (0.1.0), unpacked from tests/releases/ and run as its own ``postbox``: its
migrations, workers and commands, beside this checkout's, on the same databases."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO

VERSION = "0.1.0"
REVISION = "0001"
ARCHIVE = REPO / "tests" / "releases" / f"postbox-{VERSION}.tar.gz"


@dataclass(frozen=True)
class Release:
    """An unpacked release: ``root`` holds its service/, sql/ and migrations/."""

    version: str
    root: Path

    @property
    def env(self) -> dict[str, str]:
        """The environment that makes ``python -m postbox`` this release (the checkout's test apps
        stay importable: an application keeps its code when it upgrades the library)."""
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.root / "service"), str(REPO)])}

    def postbox(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "postbox", *args],
            env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip


def unpack(into: Path) -> Release:
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(into, filter="data")
    root = into / f"postbox-{VERSION}"
    release = Release(VERSION, root)
    probe = subprocess.run(
        [sys.executable, "-c", "import postbox, sys; sys.stdout.write(postbox.__version__ + ' ' + postbox.__file__)"],
        env=release.env, cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    version, path = probe.stdout.split(" ", 1)
    assert version == VERSION and Path(path).is_relative_to(root), probe.stdout
    return release
