"""What the patched mxnet 1.9.1 calls when the switch ``KVSTORE_LAZY=1`` is on (patches/, ``kvstore-lazy patch``).

Owns: the behaviour of Gluon (Parameter, Trainer, Block.save_parameters) and Module (init_params, init_optimizer,
get_params, optimizer states, fit) with lazy row_sparse weights in a dist job. The patches are one-line hooks that
call the functions here and fall through to the stock code when they return False/None; with the switch off the
patched mxnet never imports this module (``mxnet/_kvstore_lazy_switch.py``).

In a worker of a dist job (``DMLC_ROLE=worker``) with the switch on:
- a ``row_sparse`` weight is never materialized: initialization leaves an empty RowSparseNDArray of the full shape
  and remembers the initializer; when the kvstore is created, the key is declared lazy to the servers with that
  initializer and the seed ``KVSTORE_LAZY_SEED`` (default 0), and ``kv.init`` ships only the rows the array holds
  (none, or the rows a checkpoint gave). Rows come from the servers as stock MXNet pulls them
  (``row_sparse_data``, ``Module.prepare``);
- saving parameters (``Block.save_parameters``, ``Module.get_params``/``save_checkpoint``/``save_params``) fetches
  only the rows that exist on the servers (:func:`kvstore_lazy.worker.fetch_rows`) instead of pulling every row;
  every file is written atomically, with the ``.lazy.json`` sidecar saying how each lazy weight was declared (key
  id, shape, dtype, initializer, seed: kvstore_lazy.persist.checkpoint), from every save path
  (``Block.save_parameters``,
  ``BaseModule.save_params``, ``mx.model.save_checkpoint``);
- ``Trainer.save_states``/``Module.save_optimizer_states`` save the optimizer states the servers hold (of existing
  rows, and of dense keys) and the update counts; the ``load_*`` counterparts restore them, onto any number of
  servers. Loading is collective, like ``kv.init``: call it on every worker.
Outside a dist worker (no ``DMLC_ROLE=worker``) everything behaves as stock, switch or not, except that loading a
checkpoint with a sidecar (:func:`loaded`: ``mx.model.load_checkpoint``, ``BaseModule.load_params``, Gluon
``load_parameters`` and ``ParameterDict.load``) gives every row of its lazy weights, the absent ones with the values
the servers computed, so a local job scores the model the dist job evaluated. The sidecar is the truth: the patched
loaders call :func:`loaded` for a file that has one whether or not the switch is set (``loader`` in
``mxnet/_kvstore_lazy_switch.py``); only a dist worker of a lazy job keeps the file's rows as they are.

Stock servers (``KVSTORE_LAZY_SERVERS=stock``, what ``python -m kvstore_lazy.launch --server stock`` sets for
workers that have the switch on): a stock server cannot compute a row, so each row_sparse weight is shipped in full
by ``kv.init``, holding the values lazy servers would have computed for it (same key ids, initializer and seed), and
everything else is stock. The same job on stock servers then starts from the lazy run's initial values, for a
comparison loss for loss, with no key id to look up.

Settings (``KVSTORE_LAZY_SEED``, ``KVSTORE_LAZY_SERVERS``) are read strictly when this module is first imported (the
first hook: a Gluon ``initialize()``, a Module's ``init_params``): a bad value is a ConfigError naming it, and an
unknown ``KVSTORE_LAZY_*`` name is logged as a warning with the name it most likely meant.

In a dist job, rows a checkpoint does not hold get their initial values from the initializer known when the key is
declared: for Gluon the one given to ``initialize()`` (else the parameter's own, else ``Uniform()``), for Module the
one given to ``init_params``/``fit`` (else ``Uniform(0.01)``). Restore with the same model and initializer to
continue exactly.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import mxnet as mx
import numpy as np

from kvstore_lazy import config, worker
from kvstore_lazy.persist import checkpoint
from kvstore_lazy.numerics.initializers import InitializerError, parse_initializer

__all__ = ["param_defer_init", "param_reduce", "trainer_init_param", "trainer_save_states", "trainer_load_states",
           "module_init_params", "module_init_param", "initialize_kvstore_for", "module_fetch_param",
           "module_save_states", "module_load_states", "module_fit_first_batch", "atomic_save", "loaded", "seed",
           "stock_servers", "STATES_FORMAT"]

log = logging.getLogger("kvstore_lazy.worker.integration")

STATES_FORMAT = "kvstore_lazy.states/1"
_META = "__kvstore_lazy_meta__"


SEED_RANGE = (-(1 << 63), (1 << 64) - 1)     # what a lazy declaration accepts (kvstore_lazy.server.declaration)


def seed() -> int:
    """KVSTORE_LAZY_SEED (default 0): a ConfigError naming it for anything but an integer in SEED_RANGE."""
    return config.integer(os.environ, "KVSTORE_LAZY_SEED", 0, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])


def stock_servers() -> bool:
    """KVSTORE_LAZY_SERVERS=stock: the job's servers are MXNet's (see the module's docstring)."""
    return config.choice(os.environ, "KVSTORE_LAZY_SERVERS") == "stock"


def _check_settings() -> None:
    for line in config.unknown_warnings(os.environ):
        log.warning("%s", line)
    seed()
    stock_servers()


def _in_dist_worker() -> bool:
    return os.environ.get("DMLC_ROLE") == "worker"


def _lazy_job() -> bool:
    """A dist worker whose servers are kvstore_lazy's: the hooks that talk to the servers apply."""
    return _in_dist_worker() and not stock_servers()


def _dist(kv) -> bool:
    return kv is not None and "dist" in kv.type


def _checked(dumps: str, name: str) -> str:
    try:
        parse_initializer(dumps)
    except InitializerError as exc:
        raise ValueError(f"kvstore_lazy (KVSTORE_LAZY=1): the initializer of row_sparse parameter {name!r}, {dumps}, "
                         f"cannot be computed row by row on the servers ({exc}). Use zero/one/constant/uniform/"
                         f"normal/xavier/msraprelu, or unset KVSTORE_LAZY.") from None
    return dumps


def _rsp(shape, row_ids, values, dtype):
    shape = tuple(int(d) for d in shape)
    if len(row_ids) == 0:
        return mx.nd.sparse.zeros("row_sparse", shape, dtype=dtype)
    return mx.nd.sparse.row_sparse_array((np.asarray(values), np.asarray(row_ids, np.int64)), shape=shape,
                                         dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# checkpoint files: written atomically with the sidecar that describes their lazy parameters; read back (outside a
# dist job) with every row present

_CONFLICT = "conflict"
# Module parameter name -> the declaration of its lazy key in this process (or _CONFLICT if two Modules declared
# the name differently): mx.model.save_checkpoint gets only the arrays, not the Module
_module_specs: dict[str, object] = {}


def _remember_module_spec(module, name: str, spec: dict) -> None:
    module.__dict__.setdefault("_kvstore_lazy_specs", {})[name] = spec
    known = _module_specs.get(name)
    _module_specs[name] = spec if known is None or known == spec else _CONFLICT


def _lazy_entries(owner, data) -> dict:
    """Entry name -> declaration, for the lazy parameters among `data` (what a checkpoint's sidecar records)."""
    if not isinstance(data, dict):
        return {}
    if isinstance(owner, dict):   # Block.save_parameters: file name -> Parameter
        specs = {name: getattr(param, "_kvstore_lazy_spec", None) for name, param in owner.items()}
    else:                         # Module checkpoints: arg:NAME
        known = owner.__dict__.get("_kvstore_lazy_specs", {}) if owner is not None else _module_specs
        specs = {f"arg:{name}": spec for name, spec in known.items()}
    found = {}
    for name, spec in specs.items():
        value = data.get(name)
        if spec is None or value is None or getattr(value, "stype", "") != "row_sparse":
            continue
        if spec is _CONFLICT:
            raise ValueError(f"kvstore_lazy: two Modules of this process declared {name[4:]!r} with different "
                             f"shapes or initializers; save it with that Module's save_checkpoint")
        found[name] = spec
    return found


def atomic_save(save_fn, owner=None):
    """A ``save_fn(fname, data)`` (mx.nd.save, npx.save) that writes atomically (temp file, fsync, rename), with
    the sidecar describing the lazy parameters among `data` (kvstore_lazy.persist.checkpoint). `owner` knows which they
    are: the dict of Parameters ``Block.save_parameters`` saves, the Module of ``save_checkpoint``, or None for
    ``mx.model.save_checkpoint`` (the Module parameters this process declared, by name)."""
    def save(fname, data):
        worker.save_ndarrays(fname, data, save_fn=save_fn, lazy=_lazy_entries(owner, data))
    return save


def loaded(fname, arrays):
    """What ``mx.nd.load(fname)`` returned, as the patched loaders (``mx.model.load_checkpoint``,
    ``Module.load_params``, Gluon ``load_parameters``, ``ParameterDict.load``) hand it on, switch or not. Each lazy
    parameter of a checkpoint with a sidecar gets every row, the absent ones with the initial values the servers
    computed for them, so scoring the loaded model reproduces what the job evaluated. Only in a dist worker of a lazy
    job (switch on, kvstore_lazy servers) the arrays stay as saved: a restore ships only the stored rows and the
    servers recompute the others on demand."""
    if not isinstance(arrays, dict) or (config.boolean(os.environ, "KVSTORE_LAZY") and _lazy_job()):
        return arrays
    params = checkpoint.lazy_params(fname)
    if not params:
        return arrays
    out = dict(arrays)
    for name, spec in params.items():
        value = arrays[name]
        all_ids = np.arange(spec["rows"], dtype=np.int64)
        full = checkpoint.lazy_rows(spec, all_ids, value.indices.asnumpy().astype(np.int64), value.data.asnumpy())
        out[name] = mx.nd.sparse.row_sparse_array((full, all_ids), shape=value.shape, dtype=value.dtype,
                                                  ctx=value.context)
        log.info("%s: %s rebuilt with all %d rows (%d stored, the rest initial values)", fname, name, spec["rows"],
                 value.indices.shape[0])
    return out


# ----------------------------------------------------------------------------------------------------------------
# optimizer-state files: one .npz (allow_pickle=False) with a JSON manifest and, per parameter, its row ids
# (row_sparse) and states

def _save_states(kv, fname: str, params) -> None:
    """`params`: (name, kv key, shape, dtype) of every parameter the kvstore holds."""
    meta: dict[str, Any] = {"format": STATES_FORMAT, "num_servers": int(os.environ.get("DMLC_NUM_SERVER", "1")),
                            "params": {}}
    arrays = {}
    for name, key, shape, dtype in params:
        got = worker.fetch_states(kv, key, shape, dtype)
        meta["params"][name] = {"kind": got["kind"], "shape": [int(d) for d in shape],
                                "num_states": len(got["states"]), "counts": got["counts"],
                                "num_update": got["num_update"]}
        if got["kind"] == "row_sparse":
            arrays[f"{name}:row_ids"] = got["row_ids"]
        for j, state in enumerate(got["states"]):
            arrays[f"{name}:state{j}"] = state
    arrays[_META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    checkpoint.atomic_write(fname, lambda fh: np.savez(fh, **arrays))


def _read_states(fname: str) -> dict:
    with np.load(fname, allow_pickle=False) as data:
        if _META not in data.files:
            raise ValueError(f"{fname} is not a kvstore_lazy optimizer-state file (KVSTORE_LAZY=1 saves states of "
                             f"a dist kvstore in that format)")
        meta = json.loads(bytes(data[_META]).decode())
        if meta.get("format") != STATES_FORMAT:
            raise ValueError(f"{fname}: unknown format {meta.get('format')!r}, expected {STATES_FORMAT!r}")
        saved = {}
        for name, info in meta["params"].items():
            entry = dict(info, states=[data[f"{name}:state{j}"] for j in range(info["num_states"])])
            if info["kind"] == "row_sparse":
                entry["row_ids"] = data[f"{name}:row_ids"]
            saved[name] = entry
    return saved


def _restore_states(kv, fname: str, params, string_keys: bool) -> None:
    """Collective: every worker registers the virtual keys, rank 0 writes the states back, then all barrier."""
    saved = _read_states(fname)
    wanted = {name: (key, shape) for name, key, shape in params}
    unknown = sorted(set(saved) - set(wanted))
    if unknown:
        log.warning("%s: states of %s, which this model does not have, are ignored", fname, unknown)
    num_states = max([len(entry["states"]) for entry in saved.values()] + [0])
    worker.register_virtual_keys(kv, num_states, string_keys=string_keys)
    if kv.rank == 0:
        for name, entry in saved.items():
            if name in wanted:
                key, shape = wanted[name]
                if tuple(entry["shape"]) != tuple(shape):
                    raise ValueError(f"{fname}: {name} has shape {tuple(entry['shape'])}, the model {tuple(shape)}")
                worker.restore_states(kv, key, shape, entry)
    kv._barrier()


def _num_states(optimizer) -> int:
    """How many state arrays `optimizer` keeps per weight (what the servers keep per key)."""
    try:
        state = optimizer.create_state_multi_precision(0, mx.nd.zeros((1, 1)))
    except Exception:  # an optimizer that cannot say: reserve every state slot  # pylint: disable=broad-except
        return 8
    flat = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif x is not None:
            flat.append(x)

    walk(state)
    return len(flat)


# ----------------------------------------------------------------------------------------------------------------
# Gluon

def param_defer_init(param, init, default_init) -> bool:
    """Parameter._finish_deferred_init: keep a row_sparse weight empty and remember its initializer.

    Stock initializes with ``create(default_init)(InitDesc(name, {'__init__': init}), data)``, i.e. ``create(init)``
    since ``init`` is set (initialize() resolves it); that is the initializer the servers compute rows with."""
    if param._stype != "row_sparse" or not _in_dist_worker():
        return False
    effective = mx.init.create(init if init is not None and init != "" else default_init)
    param._kvstore_lazy_init = (init, default_init, _checked(effective.dumps(), param.name))
    return True


def _gluon_dumps(param) -> str:
    recorded = getattr(param, "_kvstore_lazy_init", None)
    if recorded is not None:
        return recorded[2]
    init = param.init if param.init is not None else mx.init.Uniform()
    return _checked(mx.init.create(init).dumps(), param.name)


def _materialize_gluon(param) -> None:
    """The stock initialization param_defer_init skipped (the kvstore turned out not to be dist)."""
    recorded = getattr(param, "_kvstore_lazy_init", None)
    if recorded is None:
        return
    init, default_init, _ = recorded
    data = mx.nd.zeros(param.shape, dtype=param.dtype, stype=param._stype)
    mx.init.create(default_init)(mx.init.InitDesc(param.name, {"__init__": init}), data)
    for arr in param._check_and_get(param._data, list):
        data.copyto(arr)
    del param._kvstore_lazy_init


def _initial_rows(kid: int, shape, dtype, dumps: str) -> np.ndarray:
    """Every row of a lazy key as kvstore_lazy servers compute it: (seed, key id, row id) -> value."""
    spec = checkpoint.lazy_spec(json.loads(worker.lazy_spec_body(kid, shape, np.dtype(dtype).name, dumps, seed())))
    row_shape = tuple(int(d) for d in shape[1:])
    return checkpoint.lazy_rows(spec, np.arange(int(shape[0]), dtype=np.int64), np.zeros(0, np.int64),
                                np.zeros((0,) + row_shape, np.dtype(dtype)))


def _full(shape, dtype, rows: np.ndarray):
    return _rsp(shape, np.arange(int(shape[0]), dtype=np.int64), rows, dtype)


def _materialize_gluon_lazily(param, idx: int) -> None:
    """Stock servers: the weight param_defer_init kept empty gets every row, with the lazy servers' values (a
    weight that holds rows got them from a checkpoint, and keeps them)."""
    recorded = getattr(param, "_kvstore_lazy_init", None)
    if recorded is None:
        return
    if param._check_and_get(param._data, list)[0].indices.shape[0]:
        del param._kvstore_lazy_init
        return
    data = _full(param.shape, param.dtype, _initial_rows(idx, param.shape, param.dtype, recorded[2]))
    for arr in param._check_and_get(param._data, list):
        data.copyto(arr)
    del param._kvstore_lazy_init


def trainer_init_param(trainer, param, idx, data) -> bool:
    """Trainer._init_params for a row_sparse parameter: declare key `idx` lazy, kv.init only the rows `data` holds
    (stock servers: the stock kv.init of every row, holding the lazy initial values)."""
    if not _in_dist_worker():
        return False
    kv = trainer._kvstore
    if not _dist(kv):
        _materialize_gluon(param)
        return False
    if stock_servers():
        _materialize_gluon_lazily(param, idx)
        return False
    worker.declare(kv, idx, param.shape, np.dtype(param.dtype).name, _gluon_dumps(param), seed())
    param._kvstore_lazy_spec = worker.declared(kv, idx)
    kv.init(idx, data)
    return True


def param_reduce(param):
    """Parameter._reduce (save_parameters, reset_ctx) of a row_sparse weight: the rows that exist, not all rows."""
    if param._stype != "row_sparse" or not _lazy_job() or param._trainer is None:
        return None
    trainer = param._trainer
    if not trainer._kv_initialized:   # as stock's _row_sparse_pull does before its pull
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    kv = trainer._kvstore
    if not _dist(kv):
        return None
    ids, values = worker.fetch_rows(kv, trainer._param2idx[param.name], param.shape, np.dtype(param.dtype).name)
    return _rsp(param.shape, ids, values, param.dtype)


def _trainer_lazy(trainer) -> bool:
    return _lazy_job() and _dist(trainer._kvstore) and bool(trainer._update_on_kvstore)


def trainer_save_states(trainer, fname) -> bool:
    """Trainer.save_states on a dist kvstore (stock refuses): the servers' optimizer states and update counts."""
    if not _trainer_lazy(trainer):
        return False
    params = [(p.name, i, p.shape, np.dtype(p.dtype).name) for i, p in enumerate(trainer._params)
              if p not in trainer._params_to_init]
    _save_states(trainer._kvstore, fname, params)
    return True


def trainer_load_states(trainer, fname) -> bool:
    """Trainer.load_states on a dist kvstore: collective (every worker calls it, as every worker kv.inits)."""
    if not _trainer_lazy(trainer):
        return False
    _restore_states(trainer._kvstore, fname, [(p.name, i, p.shape) for i, p in enumerate(trainer._params)],
                    string_keys=False)
    return True


# ----------------------------------------------------------------------------------------------------------------
# Module

def module_init_params(module, initializer) -> None:
    """Top of Module.init_params (also reached when it returns early after Module.load): the initializer for rows
    a checkpoint does not hold."""
    if initializer is not None and _in_dist_worker():
        module._kvstore_lazy_initializer = initializer


def _module_dumps(desc, initializer) -> str:
    """What ``initializer(desc, arr)`` would do to a weight, as an initializer string the servers compute."""
    init = desc.attrs.get("__init__", "") if hasattr(desc, "attrs") else ""
    name = str(desc)
    if init:
        return _checked(mx.init.create(init).dumps(), name)
    if isinstance(initializer, mx.init.Mixed):
        for pattern, sub in initializer.map:
            if pattern.match(name):
                return _module_dumps(desc, sub)
        raise ValueError(f"kvstore_lazy: no pattern of the Mixed initializer matches {name!r}")
    if name.endswith(("bias", "beta", "min", "moving_mean", "moving_inv_var", "moving_avg")):
        return '["zero", {}]'
    if name.endswith(("gamma", "max", "moving_var")):
        return '["one", {}]'
    return _checked(initializer.dumps(), name)


def module_init_param(module, desc, arr, initializer, arg_params, allow_missing) -> bool:
    """Module.init_params for one parameter: True leaves a row_sparse weight empty (its rows stay on the servers);
    False lets stock code copy it from `arg_params` (only the rows a loaded RowSparseNDArray holds) or initialize
    it."""
    if arr.stype != "row_sparse" or not _in_dist_worker():
        return False
    name = str(desc)
    inits = module.__dict__.setdefault("_kvstore_lazy_inits", {})
    if initializer is not None:
        inits[name] = _module_dumps(desc, initializer)
    if arg_params is not None and (name in arg_params or not allow_missing):
        return False
    if initializer is None:
        return False
    if arr.indices.shape[0]:
        mx.nd.sparse.zeros("row_sparse", arr.shape, dtype=arr.dtype).copyto(arr)
    module.__dict__.setdefault("_kvstore_lazy_deferred", {})[name] = (desc, initializer)
    return True


def _module_key_dumps(module, name: str) -> str:
    inits = module.__dict__.get("_kvstore_lazy_inits", {})
    if name in inits:
        return inits[name]
    initializer = module.__dict__.get("_kvstore_lazy_initializer") or mx.init.Uniform(0.01)
    attrs = module._symbol.attr_dict()
    return _module_dumps(mx.init.InitDesc(name, attrs.get(name, None)), initializer)


def _materialize_module(module) -> None:
    deferred = module.__dict__.pop("_kvstore_lazy_deferred", {})
    for name, (desc, initializer) in deferred.items():
        initializer(desc, module._arg_params[name])
    if deferred:
        module._exec_group.set_params(module._arg_params, module._aux_params)


def initialize_kvstore_for(module):
    """Module.init_optimizer's ``_initialize_kvstore``: row_sparse weights declared lazy and kv.init'ed with the
    rows they hold; dense ones as stock; then the virtual keys a string-key KVStore needs to fetch rows/states."""
    def initialize(kvstore, param_arrays, arg_params, param_names, update_on_kvstore):
        if not (_in_dist_worker() and _dist(kvstore) and update_on_kvstore):
            _materialize_module(module)
            return mx.model._initialize_kvstore(kvstore, param_arrays, arg_params, param_names, update_on_kvstore)
        if stock_servers():
            return _initialize_stock_kvstore(module, kvstore, param_arrays, arg_params, param_names)
        module.__dict__.pop("_kvstore_lazy_deferred", None)
        worker.track(kvstore)
        for idx, param_on_devs in enumerate(param_arrays):
            name = param_names[idx]
            value = arg_params[name]
            if value.stype == "row_sparse":
                worker.declare(kvstore, name, value.shape, np.dtype(value.dtype).name, _module_key_dumps(module, name),
                               seed())
                _remember_module_spec(module, name, worker.declared(kvstore, name))
                kvstore.init(name, value)
            else:
                kvstore.broadcast(name, value, out=param_on_devs)
        worker.register_virtual_keys(kvstore, _num_states(module._optimizer), string_keys=True)
        return None
    return initialize


def _initialize_stock_kvstore(module, kvstore, param_arrays, arg_params, param_names) -> None:
    """Stock servers: ``_initialize_kvstore`` (update on kvstore) with each deferred row_sparse weight given every
    row, holding the values lazy servers would have computed (its key id: its place in the string keys' order)."""
    deferred = module.__dict__.pop("_kvstore_lazy_deferred", {})
    worker.track(kvstore)
    for idx, param_on_devs in enumerate(param_arrays):
        name = param_names[idx]
        value = arg_params[name]
        if name in deferred:
            kid = worker.key_id(kvstore, name)
            _full(value.shape, value.dtype, _initial_rows(kid, value.shape, value.dtype,
                                                          _module_key_dumps(module, name))).copyto(value)
        if value.stype != "default":
            kvstore.init(name, value)
        else:
            kvstore.broadcast(name, value, out=param_on_devs)
    if deferred:
        module._exec_group.set_params(module._arg_params, module._aux_params)


def _module_lazy(module) -> bool:
    return _lazy_job() and _dist(module._kvstore) and bool(module._update_on_kvstore)


def module_fetch_param(module, name, value) -> bool:
    """Module._sync_params_from_devices for a row_sparse weight: only the rows that exist, into `value`."""
    if not _module_lazy(module):
        return False
    ids, values = worker.fetch_rows(module._kvstore, name, value.shape, np.dtype(value.dtype).name)
    _rsp(value.shape, ids, values, value.dtype).copyto(value)
    value.wait_to_read()   # copyto is asynchronous and changes the row count, which mx.nd.save reads without waiting
    return True


def _module_params(module):
    return [(name, name, module._arg_params[name].shape) for name in module._param_names]


def module_save_states(module, fname) -> bool:
    """Module.save_optimizer_states on a dist kvstore (stock refuses): the servers' states and update counts."""
    if not _module_lazy(module):
        return False
    _save_states(module._kvstore, fname, [(name, key, shape, np.dtype(module._arg_params[name].dtype).name)
                                          for name, key, shape in _module_params(module)])
    return True


def module_load_states(module, fname) -> bool:
    """Module.load_optimizer_states on a dist kvstore: collective (every worker, e.g. through Module.load)."""
    if not _module_lazy(module):
        return False
    _restore_states(module._kvstore, fname, _module_params(module), string_keys=True)
    return True


def module_fit_first_batch(module, data_batch, sparse_row_id_fn) -> None:
    """BaseModule.fit trains each epoch's first batch without prepare(); stock gets away with it because the
    executor holds every row. A lazy weight holds only the rows last pulled, so pull the first batch's rows too."""
    if sparse_row_id_fn is not None and _lazy_job():
        module.prepare(data_batch, sparse_row_id_fn=sparse_row_id_fn)


_check_settings()   # at the first hook, not at the first forward
