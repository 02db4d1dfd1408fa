"""Make an installed package look uninstalled, as on a machine without it (`s3fs` without the s3 extra).

A folder put first on the import path holds a package of that name whose import raises the same
ModuleNotFoundError Python raises for a package that is not there. `shadow_path()` gives the
folder, for a child process's PYTHONPATH; `hide_package()` does it in this process for one test.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from fsspec.registry import _registry as fsspec_registry  # the public `registry` is a read-only view


def shadow_path(tmp_path: Path, package: str) -> Path:
    """A folder whose `package` fails to import with "No module named 'package'"."""
    folder = tmp_path / f"without-{package}"
    (folder / package).mkdir(parents=True, exist_ok=True)
    (folder / package / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{package}'\", name={package!r})\n"
    )
    return folder


def hide_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, package: str, protocols: Iterable[str] = ()) -> None:
    """Until the test ends, importing `package` fails, and fsspec forgets the `protocols` it had loaded from it."""
    monkeypatch.syspath_prepend(str(shadow_path(tmp_path, package)))
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    for protocol in protocols:
        monkeypatch.delitem(fsspec_registry, protocol, raising=False)  # where fsspec keeps each class it loaded
