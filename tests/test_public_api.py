"""The public API: every name of ``kvstore_lazy.__all__`` resolves to the object of the room that owns it, the list
is the one users were told (a rename or a move inside the package must keep it, or fail here), and importing the
package or its server-side names never imports mxnet."""
import importlib
import subprocess
import sys

import pytest

import kvstore_lazy

WORKER = ["init_lazy", "declare", "declared", "track", "key_id", "lazy_spec_body", "fetch_rows", "fetch_states",
          "restore_states", "save_rows", "save_ndarrays", "stats", "snapshot", "register_virtual_keys"]
TOOLS = ["densify", "inspect", "lazy_params", "launch", "cli"]


def test_all_lists_the_public_names():
    assert kvstore_lazy.__all__ == ["__version__", *WORKER, *TOOLS]
    assert set(kvstore_lazy.__all__) == {"__version__"} | set(kvstore_lazy._EXPORTS) | set(kvstore_lazy._MODULES)
    from kvstore_lazy import worker
    assert sorted(worker.__all__) == sorted(WORKER)   # the worker module says the same


def test_every_public_name_is_the_owners_object():
    from kvstore_lazy import cli, worker
    from kvstore_lazy.launch import command
    from kvstore_lazy.persist import densify, sidecar
    for name in WORKER:
        assert getattr(kvstore_lazy, name) is getattr(worker, name), name
        assert callable(getattr(kvstore_lazy, name)), name
    assert kvstore_lazy.densify is densify.densify and kvstore_lazy.inspect is densify.inspect
    assert kvstore_lazy.lazy_params is sidecar.lazy_params
    launch = importlib.import_module("kvstore_lazy.launch")
    assert kvstore_lazy.launch is launch and launch.main is command.main
    assert kvstore_lazy.cli is cli and callable(cli.main)
    assert set(kvstore_lazy.__all__) <= set(dir(kvstore_lazy))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        kvstore_lazy.no_such_name  # noqa: B018 (the access is the test)


def test_the_package_and_its_tools_do_not_import_mxnet():
    code = ("import sys, kvstore_lazy; kvstore_lazy.densify; kvstore_lazy.inspect; kvstore_lazy.lazy_params; "
            "kvstore_lazy.launch; kvstore_lazy.cli; import kvstore_lazy.node.runtime; "
            "assert not any(m == 'mxnet' or m.startswith('mxnet.') for m in sys.modules), 'mxnet imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
