"""What the two packages install and import: the daemon never needs torch.

``pip install cached-daemon`` brings cached-client for the wire protocol, without torch
(an extra of cached-client's); deploy/check/systemd.sh installs the daemon into a fresh
environment for real and checks ``pip check`` and that torch is absent. Here: the daemon's
modules import and serve with torch unimportable, and the client says what to install when
a torch part is asked for without it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# torch made unimportable in a fresh interpreter, as in an environment without it: a finder
# ahead of the others answers as the import system does for a module it cannot find.
NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_torch_is_an_extra_of_the_client_and_the_daemon_does_not_ask_for_it() -> None:
    client = tomllib.loads((ROOT / "client" / "pyproject.toml").read_text())["project"]
    daemon = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in client["dependencies"] if d.startswith("torch")]
    assert client["optional-dependencies"]["torch"] == ["torch>=2.1"]
    assert [d for d in daemon["dependencies"] if d.startswith("cached-client")] == [
        "cached-client==0.1.0"
    ]


def test_the_daemon_imports_and_parses_its_config_without_torch() -> None:
    done = run(
        "import cached.daemon, cached.server, cached.cli, cached.fetcher\n"
        "from cached.config import load\n"
        "from cached_client import CachedClientError, transport, reader\n"
        "from cached_wire import protocol, urls\n"
        "load(None, env={})\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_torch_part_of_the_client_without_torch_says_what_to_install() -> None:
    done = run("from cached_client import CachedDataset")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: cached_client.CachedDataset needs torch"), last
    assert "pip install 'cached-client[torch]'" in last


def _imported(package: Path) -> dict[str, set[str]]:
    """Each module file under ``package`` (relative path) -> the top-level packages it
    imports anywhere in it (functions included); relative imports stay in the package."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        tops: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = tops
    return found


def test_the_wire_has_one_home_that_imports_neither_package() -> None:
    """cached_wire (the protocol, URLs, units, the catalog, the packed layout) imports
    neither the daemon nor the client; the client never imports the daemon; below its CLI,
    no room of the daemon imports the client or the demo (docs/decisions.md D52)."""
    ours = {"cached", "cached_client", "cached_wire", "cached_demo"}
    wire = _imported(ROOT / "client" / "cached_wire")
    client = _imported(ROOT / "client" / "cached_client")
    daemon = _imported(ROOT / "cached")
    assert {m: t & ours for m, t in wire.items() if t & ours} == {}
    assert {
        m: t & {"cached", "cached_demo"} for m, t in client.items() if t & ours - {"cached_wire"}
    } == {}
    below_cli = {
        m: t & {"cached_client", "cached_demo"} for m, t in daemon.items() if m != "cached/cli.py"
    }
    assert {m: t for m, t in below_cli.items() if t} == {}
    assert "cached_wire" in set().union(*daemon.values())  # the daemon speaks through it
