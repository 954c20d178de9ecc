"""The generated reference pages (docs/reference/) say what the code says, and the code reads no undocumented
variable.

The pages are regenerated in memory by scripts/gen_reference.py and compared with the committed ones; every
``KVSTORE_LAZY_*`` name anywhere in the package's source or in the mxnet patches (comments and docstrings included:
a name a reader meets must be in the table) must be a variable of ``kvstore_lazy.config.VARIABLES``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from kvstore_lazy import config

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"KVSTORE_LAZY_[A-Z_]+")
# prefixes of variable families that are not settings (config.unknown ignores them: the docker image's and the
# tests' own variables); a name ending in "_" is a prefix, and only these may appear
PREFIXES = {"KVSTORE_LAZY_DOCKER_", "KVSTORE_LAZY_TEST_"}


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def names_in_sources() -> dict[str, set[str]]:
    """{name: files it appears in} over kvstore_lazy/**/*.py and patches/*.diff."""
    files = sorted((ROOT / "kvstore_lazy").rglob("*.py")) + sorted((ROOT / "patches").glob("*.diff"))
    assert len(files) > 20
    found: dict[str, set[str]] = {}
    for path in files:
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("path", sorted(gen.PAGES, key=str), ids=str)
def test_committed_page_is_what_the_code_generates(path):
    committed = (ROOT / path).read_text() if (ROOT / path).exists() else "(missing)"
    assert committed == gen.PAGES[path](), \
        f"{path} differs from what the code defines: regenerate it with `{gen.REGENERATE}` and commit it"


def test_every_variable_the_code_names_is_in_the_table():
    found = names_in_sources()
    assert "KVSTORE_LAZY_MEMORY_BUDGET" in found and "KVSTORE_LAZY_SEED" in found   # the scan sees code and patches
    missing = {name: sorted(files) for name, files in sorted(found.items())
               if name not in config.BY_NAME and name not in PREFIXES}
    assert not missing, f"KVSTORE_LAZY_* names the code uses but kvstore_lazy/config.py's VARIABLES lacks: {missing}"


def test_every_variable_and_option_is_on_its_page():
    environment = gen.environment_page()
    for var in config.VARIABLES:
        assert f"| `{var.name}` |" in environment
    cli = gen.cli_page()
    launcher = gen.launcher_parser()
    for action in launcher._actions:
        if isinstance(action, gen.argparse._HelpAction):
            continue
        for option in action.option_strings:
            assert f"`{option}`" in cli
    for command, _ in gen.console_scripts():
        assert f"### `{command}`" in cli


def test_a_change_in_the_table_changes_the_page(monkeypatch):
    before = gen.environment_page()
    extra = dataclasses.replace(config.VARIABLES[1], name="KVSTORE_LAZY_NOT_A_SETTING", doc="An example.")
    monkeypatch.setattr(config, "VARIABLES", config.VARIABLES + (extra,))
    after = gen.environment_page()
    assert after != before and "| `KVSTORE_LAZY_NOT_A_SETTING` |" in after


def test_pages_do_not_depend_on_this_machine(monkeypatch):
    cli = gen.cli_page()
    monkeypatch.setenv("KVSTORE_LAZY_LOG_LEVEL", "DEBUG")
    assert gen.cli_page() == cli
    assert gen.sys.executable not in cli
