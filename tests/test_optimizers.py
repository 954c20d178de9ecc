"""Tests for kvstore_lazy/numerics/optimizers/: restricted unpickling, and numeric parity with MXNet 1.9.1.

Each test pickles a real mx.optimizer object with protocol 0, as the worker does. It
loads the pickle with load_optimizer and runs the same steps through mxnet's Updater
and through our numpy update.

Result: every optimizer case below is bit-identical to MXNet 1.9.1 on CPU, and the
tests check that with array_equal. The dense cases cover SGD (momentum on and off,
aggregated and not, wd, clip, rescale, lr schedulers, lr/wd multipliers), NAG,
Signum/signSGD, Adam, AdaGrad, Ftrl, RMSProp (plain and centered, clip_weights) and
Test. The row_sparse lazy cases cover SGD, Adam, AdaGrad and Ftrl. Those are the
optimizers whose MXNet kernels have a lazy row_sparse path; the others fall back to
dense storage in MXNet. float16 weights without multi_precision only match within
fp16 tolerance: MXNet rounds to fp16 after every operation, and we round once.
"""
import importlib.util
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import mxnet as mx
from kvstore_lazy.numerics import optimizers
from kvstore_lazy.numerics.optimizers import (Optimizer, UnsafePickleError, UnsupportedOptimizerError,
                                     load_optimizer)

OPT, LRS = mx.optimizer, mx.lr_scheduler
SHAPES = {0: (5, 7), 1: (13,)}
STEPS = 5


def _sgd_no_aggregation(**kw):
    opt = OPT.SGD(**kw)
    opt.aggregate_num = 0      # what MXNET_OPTIMIZER_AGGREGATION_SIZE=0 on the worker gives
    return opt


def _with_mults(opt):
    opt.set_lr_mult({'fc_weight': 2.0})
    opt.set_wd_mult({'fc_weight': 0.5})
    return opt


IDX2NAME = {0: 'fc_weight', 1: 'fc_bias'}

DENSE_CASES = {
    'sgd': lambda: OPT.SGD(learning_rate=0.1),
    'sgd-wd-rescale': lambda: OPT.SGD(learning_rate=0.1, wd=1e-3, rescale_grad=1 / 3),
    'sgd-wd-noaggregate': lambda: _sgd_no_aggregation(learning_rate=0.1, wd=1e-3, clip_gradient=0.7),
    'sgd-mom-wd-clip': lambda: OPT.SGD(learning_rate=0.05, momentum=0.9, wd=1e-4,
                                       clip_gradient=0.5, rescale_grad=0.125),
    'sgd-mom-noaggregate': lambda: _sgd_no_aggregation(learning_rate=0.05, momentum=0.9, wd=1e-4),
    'sgd-factor-sched': lambda: OPT.SGD(momentum=0.9, lr_scheduler=LRS.FactorScheduler(
        step=2, factor=0.5, base_lr=0.1)),
    'sgd-multifactor-mults': lambda: _with_mults(OPT.SGD(
        momentum=0.5, wd=0.01, param_idx2name=IDX2NAME,
        lr_scheduler=LRS.MultiFactorScheduler([2, 4], factor=0.3, base_lr=0.2))),
    'nag-mom-wd': lambda: OPT.NAG(learning_rate=0.1, momentum=0.9, wd=1e-3),
    'nag-mom-clip-rescale': lambda: OPT.NAG(momentum=0.8, clip_gradient=0.3, rescale_grad=0.5, wd=1e-2),
    'nag-nomom': lambda: OPT.NAG(learning_rate=0.1, wd=1e-2),
    'signum': lambda: OPT.Signum(learning_rate=0.01, momentum=0.9, wd=1e-3),
    'signum-wdlh-clip': lambda: OPT.Signum(momentum=0.7, wd_lh=0.01, clip_gradient=0.2, rescale_grad=0.5),
    'signsgd': lambda: OPT.Signum(learning_rate=0.01, momentum=0.0, wd=1e-2),
    'adam': lambda: OPT.Adam(),
    'adam-wd-clip-rescale': lambda: OPT.Adam(learning_rate=0.01, wd=1e-3, clip_gradient=0.5,
                                             rescale_grad=0.25),
    'adam-poly-warmup-mults': lambda: _with_mults(OPT.Adam(
        param_idx2name=IDX2NAME, wd=1e-2, lr_scheduler=LRS.PolyScheduler(
            max_update=10, base_lr=0.01, pwr=2, warmup_steps=2, warmup_begin_lr=0.001))),
    'adagrad': lambda: OPT.AdaGrad(learning_rate=0.1),
    'adagrad-wd-clip-rescale': lambda: OPT.AdaGrad(learning_rate=0.1, wd=1e-3, clip_gradient=0.5,
                                                   rescale_grad=0.5, eps=1e-6),
    'ftrl': lambda: OPT.Ftrl(lamda1=0.001),
    'ftrl-wd-clip-rescale': lambda: OPT.Ftrl(lamda1=0.01, learning_rate=0.05, beta=0.5, wd=1e-3,
                                             clip_gradient=0.5, rescale_grad=2.0),
    'rmsprop': lambda: OPT.RMSProp(),
    'rmsprop-wd-clipw-clipg': lambda: OPT.RMSProp(learning_rate=0.01, wd=1e-3, clip_weights=0.5,
                                                  clip_gradient=1.0, rescale_grad=0.5),
    'rmsprop-centered': lambda: OPT.RMSProp(centered=True, learning_rate=0.01, gamma1=0.95,
                                            gamma2=0.9, wd=1e-3),
    'rmsprop-centered-cosine-clipw': lambda: OPT.RMSProp(
        centered=True, clip_weights=1.0, clip_gradient=0.8,
        lr_scheduler=LRS.CosineScheduler(max_update=6, base_lr=0.01, warmup_steps=1)),
    'test': lambda: OPT.Test(rescale_grad=0.5),
}


def _states_as_numpy(state):
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in _states_as_numpy(s)]
    return [state.asnumpy()]


def _data(seed):
    rng = np.random.RandomState(seed)
    weights = {k: rng.randn(*s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: (rng.randn(*s) * 2).astype(np.float32) for k, s in SHAPES.items()}
             for _ in range(STEPS)]
    return weights, grads


@pytest.fixture(params=['kernels', 'numpy'])
def code_path(request, monkeypatch):
    """SGD/Adam run float32 arrays through the C kernels; 'numpy' forces their numpy expressions (what other dtypes
    take), so both stay pinned to MXNet."""
    if request.param == 'numpy':
        monkeypatch.setattr(optimizers.kernels, 'accepts', lambda weight, tables, slots, grad: False)
    return request.param


@pytest.mark.parametrize('case', sorted(DENSE_CASES))
def test_dense_matches_mxnet(case, code_path):
    make = DENSE_CASES[case]
    ours = load_optimizer(pickle.dumps(make(), 0))
    assert isinstance(ours, Optimizer)
    updater = OPT.get_updater(make())
    weights, grads = _data(zlib.crc32(case.encode()))
    mx_w = {k: mx.nd.array(w) for k, w in weights.items()}
    np_w = {k: w.copy() for k, w in weights.items()}
    np_s = {k: ours.init_states(w) for k, w in np_w.items()}
    for step in range(STEPS):
        for key in SHAPES:
            updater(key, mx.nd.array(grads[step][key]), mx_w[key])
            ours.update(key, np_w[key], grads[step][key], np_s[key])
            expect = mx_w[key].asnumpy()
            assert np_w[key].dtype == np.float32
            np.testing.assert_allclose(np_w[key], expect, rtol=1e-6, atol=1e-7,
                                       err_msg=f'{case} step {step} key {key}')
            assert np.array_equal(np_w[key], expect), f'{case}: not bit-identical at step {step}'
    for key in SHAPES:
        expect_states = _states_as_numpy(updater.states[key])
        assert len(expect_states) == ours.num_states() == len(np_s[key])
        for ours_s, mx_s in zip(np_s[key], expect_states):
            assert ours_s.dtype == np.float32
            assert np.array_equal(ours_s, mx_s), f'{case}: state differs'


SPARSE_CASES = {
    'sgd-wd-clip': lambda: OPT.SGD(learning_rate=0.1, wd=1e-3, clip_gradient=0.5, rescale_grad=0.5),
    'sgd-mom-wd-clip': lambda: OPT.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3, clip_gradient=0.5),
    'adam-wd-clip': lambda: OPT.Adam(learning_rate=0.01, wd=1e-3, clip_gradient=0.5, rescale_grad=0.5),
    'adam': lambda: OPT.Adam(learning_rate=0.01),
    'sgd-mom': lambda: OPT.SGD(learning_rate=0.1, momentum=0.9),
    'adam-clip-rescale': lambda: OPT.Adam(learning_rate=0.02, clip_gradient=0.3, rescale_grad=2.0, epsilon=1e-6),
    'adagrad-clip': lambda: OPT.AdaGrad(learning_rate=0.1, clip_gradient=0.5, rescale_grad=0.5),
    'ftrl-wd-clip': lambda: OPT.Ftrl(lamda1=0.01, learning_rate=0.05, wd=1e-3, clip_gradient=0.5),
}


FUSED = {'sgd-wd-clip', 'sgd-mom-wd-clip', 'sgd-mom', 'adam-wd-clip', 'adam', 'adam-clip-rescale'}


@pytest.mark.parametrize('path', ['gathered', 'in_place'])
@pytest.mark.parametrize('case', sorted(SPARSE_CASES))
def test_row_sparse_lazy_matches_mxnet(case, path, code_path):
    """Both server paths: gather the rows, update, scatter; and update_rows on the whole tables in place
    (compiled kernels, SGD and Adam; the other optimizers must decline it)."""
    make = SPARSE_CASES[case]
    ours = load_optimizer(pickle.dumps(make(), 0))
    updater = OPT.get_updater(make())
    rng = np.random.RandomState(7)
    rows, cols, key = 10, 4, 3
    initial = rng.randn(rows, cols).astype(np.float32)
    mx_w = mx.nd.sparse.row_sparse_array((initial, np.arange(rows)), shape=(rows, cols))
    np_w = initial.copy()
    np_s = ours.init_states(np_w)
    touched = set()
    for _ in range(STEPS):
        idx = np.sort(rng.choice(rows - 2, size=4, replace=False))   # the last 2 rows never get grads
        touched.update(idx.tolist())
        g = rng.randn(len(idx), cols).astype(np.float32)
        updater(key, mx.nd.sparse.row_sparse_array((g, idx), shape=(rows, cols)), mx_w)
        fused = path == 'in_place' and ours.update_rows(key, np_w, np_s, idx.astype(np.int64), g)
        assert fused == (path == 'in_place' and case in FUSED and code_path == 'kernels')
        if not fused:   # gather, update, scatter
            w_rows, s_rows = np_w[idx], [s[idx] for s in np_s]
            ours.update(key, w_rows, g, s_rows, row_sparse=True)
            np_w[idx] = w_rows
            for s, rows_s in zip(np_s, s_rows):
                s[idx] = rows_s
        expect = mx_w.asnumpy()
        np.testing.assert_allclose(np_w, expect, rtol=1e-6, atol=1e-7)
        assert np.array_equal(np_w, expect), f'{case}: not bit-identical'
    untouched = sorted(set(range(rows)) - touched)
    assert untouched and np.array_equal(np_w[untouched], initial[untouched])
    for ours_s, mx_s in zip(np_s, _states_as_numpy(updater.states[key])):
        assert np.array_equal(ours_s, mx_s)
        assert not ours_s[untouched].any()


@pytest.mark.filterwarnings('ignore:Accumulating with float16')
def test_float16_weights():
    make = lambda: OPT.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3)  # noqa: E731
    ours = load_optimizer(pickle.dumps(make(), 0))
    updater = OPT.get_updater(make())
    weights, grads = _data(3)
    w16 = weights[0].astype(np.float16)
    mx_w = mx.nd.array(w16, dtype=np.float16)
    states = ours.init_states(w16)
    for step in range(STEPS):
        g16 = grads[step][0].astype(np.float16)
        updater(0, mx.nd.array(g16, dtype=np.float16), mx_w)
        ours.update(0, w16, g16, states)
        assert w16.dtype == np.float16
        np.testing.assert_allclose(w16, mx_w.asnumpy(), rtol=1e-2, atol=1e-3)


def test_bookkeeping_matches_mxnet():
    """Update counts (with begin_num_update), stateful scheduler, lr/wd multipliers by index and by name."""
    def make():
        opt = OPT.SGD(learning_rate=1.0, wd=0.1, begin_num_update=3, param_idx2name={5: 'a_weight', 6: 'a_bias'},
                      lr_scheduler=LRS.FactorScheduler(step=1, factor=0.5, base_lr=1.0))
        opt.set_lr_mult({'a_bias': 3.0, 7: 0.25})
        opt.set_wd_mult({7: 2.0})
        return opt
    ref, ours = make(), load_optimizer(pickle.dumps(make(), 0))
    w, g = np.zeros(2, np.float32), np.ones(2, np.float32)
    for key in (5, 5, 6, 7, 5, 6):
        ref._update_count(key)
        lr, wd = ref._get_lr(key), ref._get_wd(key)
        ours.update(key, w, g, [])
        assert ours.update_counts() == ref._index_update_count
        assert ours.num_update == ref.num_update
        assert ours.lr_scheduler.base_lr == ref.lr_scheduler.base_lr
        assert (ours._get_lr(key), ours._get_wd(key)) == (lr, wd)


# ---------------------------------------------------------------------------------------- unpickler

class _RunsCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}',))


class NotAnOptimizer:
    def __init__(self):
        self.lr = 0.1


class MySGD(OPT.SGD):
    pass


def test_rejects_os_system(tmp_path):
    marker = tmp_path / 'pwned'
    body = pickle.dumps(_RunsCommand(marker), 0)
    with pytest.raises(UnsafePickleError, match=f'{os.system.__module__}.system'):
        load_optimizer(body)
    assert not marker.exists()


def test_rejects_non_mxnet_class():
    with pytest.raises(UnsafePickleError, match=f'{NotAnOptimizer.__module__}.NotAnOptimizer'):
        load_optimizer(pickle.dumps(NotAnOptimizer(), 0))
    with pytest.raises(UnsafePickleError, match=f'{MySGD.__module__}.MySGD'):
        load_optimizer(pickle.dumps(MySGD(), 0))


def test_rejects_unsupported_mxnet_optimizer_and_scheduler():
    with pytest.raises(UnsupportedOptimizerError, match='mxnet.optimizer.optimizer.LAMB'):
        load_optimizer(pickle.dumps(OPT.LAMB(), 0))
    with pytest.raises(UnsupportedOptimizerError, match='mxnet.optimizer.optimizer.AdaDelta'):
        load_optimizer(pickle.dumps(OPT.AdaDelta(), 0))


@pytest.mark.parametrize('body', [
    b'garbage bytes \x00\xff',
    b'',
    pickle.dumps(OPT.SGD(momentum=0.9), 0)[:-40],            # truncated
    pickle.dumps({'lr': 0.1}, 0),                             # valid pickle, not an optimizer
    pickle.dumps(LRS.FactorScheduler(step=2), 0),             # allowed class, wrong top-level type
    b'ccopy_reg\n_reconstructor\n(cmxnet.optimizer.optimizer\nSGD\ncposix\nsystem\nS"echo x"\ntR.',
    # _reconstructor with a base other than object (would call base.__new__/__init__ with state)
    b'ccopy_reg\n_reconstructor\n(cmxnet.optimizer.optimizer\nSGD\ncmxnet.optimizer.optimizer\nSGD\nNtR.',
    # an allowed class whose state lacks the attributes update() needs
    b'ccopy_reg\n_reconstructor\n(cmxnet.optimizer.optimizer\nSGD\nc__builtin__\nobject\nNtR(dVlr\nF0.1\nsb.',
])
def test_rejects_malformed(body):
    with pytest.raises(UnsafePickleError):
        load_optimizer(body)


def test_accepts_bytes_like_and_exposes_interface():
    body = pickle.dumps(OPT.Adam(rescale_grad=0.5), 0)
    for form in (body, bytearray(body), memoryview(body)):
        opt = load_optimizer(form)
        assert opt.name == 'adam' and opt.rescale_grad == 0.5 and opt.num_states() == 2
        assert [s.dtype for s in opt.init_states(np.ones(3, np.float32))] == [np.float32] * 2


def test_server_side_never_imports_mxnet(tmp_path):
    body_file = tmp_path / 'body'
    body_file.write_bytes(pickle.dumps(OPT.SGD(momentum=0.9, lr_scheduler=LRS.FactorScheduler(2)), 0))
    root = Path(__file__).resolve().parents[1]
    package = root / 'kvstore_lazy' / 'numerics' / 'optimizers' / '__init__.py'
    script = f'''
import importlib, pkgutil, sys, numpy as np
sys.path.insert(0, {str(root)!r})
import kvstore_lazy.numerics.optimizers as m
assert m.__file__ == {str(package)!r}, m.__file__     # this checkout's package, and every module in it
for info in pkgutil.iter_modules(m.__path__):
    importlib.import_module(m.__name__ + '.' + info.name)
opt = m.load_optimizer(open({str(body_file)!r}, 'rb').read())
w = np.ones(4, np.float32); opt.update(0, w, w.copy(), opt.init_states(w))
assert not any(name == 'mxnet' or name.startswith('mxnet.') for name in sys.modules), 'mxnet imported'
'''
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    subprocess.run([sys.executable, '-c', script], check=True, env=env, cwd=tmp_path)
    assert importlib.util.find_spec('mxnet') is not None   # i.e. it was importable, yet not imported


# --------------------------------------------------------------------------------------
# Issue 11, defect 4: every field the server computes with is checked when the pickle
# arrives. Each case below is a stock optimizer whose state was altered after __init__
# (which is what reaches the server: the pickle never goes through __init__ there).
# --------------------------------------------------------------------------------------
def _altered(make, **fields):
    def build():
        obj = make()
        target = obj
        for name, value in fields.items():
            if name.startswith('sched_'):
                target, name = obj.lr_scheduler, name[len('sched_'):]
            setattr(target, name, value)
        return obj
    return build


def _factor(**kw):
    return lambda: OPT.SGD(learning_rate=0.1, lr_scheduler=LRS.FactorScheduler(step=10, factor=0.5, **kw))


def _multifactor():
    return OPT.SGD(learning_rate=0.1, lr_scheduler=LRS.MultiFactorScheduler(step=[10, 20], factor=0.5))


def _poly():
    return OPT.SGD(learning_rate=0.1, lr_scheduler=LRS.PolyScheduler(max_update=100, base_lr=0.1, pwr=2))


def _cosine():
    return OPT.SGD(learning_rate=0.1, lr_scheduler=LRS.CosineScheduler(max_update=100, base_lr=0.1))


UNUSABLE = {
    # the observed one: FactorScheduler.__call__ never returns
    'factor-step-0': (_altered(_factor(), sched_step=0), 'FactorScheduler.step = 0'),
    'factor-step-negative': (_altered(_factor(), sched_step=-3), 'FactorScheduler.step = -3'),
    'factor-step-float': (_altered(_factor(), sched_step=1e-300), 'FactorScheduler.step'),
    'factor-step-nan': (_altered(_factor(), sched_step=float('nan')), 'FactorScheduler.step'),
    'factor-factor-above-1': (_altered(_factor(), sched_factor=2.0), 'FactorScheduler.factor'),
    'factor-count-string': (_altered(_factor(), sched_count='0'), 'FactorScheduler.count'),
    'factor-billions-of-steps': (_altered(_factor(), begin_num_update=2 ** 52, num_update=2 ** 52),
                                 'FactorScheduler: update'),
    'warmup-mode': (_altered(_factor(), sched_warmup_mode='cubic'), 'warmup_mode'),
    'warmup-steps-negative': (_altered(_factor(), sched_warmup_steps=-1), 'warmup_steps'),
    'multifactor-not-increasing': (_altered(_multifactor, sched_step=[20, 10]), 'MultiFactorScheduler.step'),
    'multifactor-zero-step': (_altered(_multifactor, sched_step=[0, 10]), 'MultiFactorScheduler.step'),
    'multifactor-not-a-list': (_altered(_multifactor, sched_step=10), 'MultiFactorScheduler.step'),
    'multifactor-index': (_altered(_multifactor, sched_cur_step_ind=7), 'cur_step_ind'),
    'poly-max-steps-0': (_altered(_poly, sched_max_steps=0), 'PolyScheduler.max_steps'),
    'poly-negative-power': (_altered(_poly, sched_power=-1.0), 'PolyScheduler.power'),
    'cosine-inconsistent': (_altered(_cosine, sched_max_steps=7), 'CosineScheduler.max_steps'),
    'scheduler-not-a-scheduler': (_altered(lambda: OPT.SGD(learning_rate=0.1), lr_scheduler=3), 'lr_scheduler'),
    'lr-nan': (_altered(lambda: OPT.SGD(learning_rate=0.1), lr=float('nan')), 'SGD.lr'),
    'lr-inf': (_altered(lambda: OPT.SGD(learning_rate=0.1), lr=float('inf')), 'SGD.lr'),
    'lr-huge-int': (_altered(lambda: OPT.SGD(learning_rate=0.1), lr=10 ** 400), 'SGD.lr'),
    'lr-none-without-scheduler': (_altered(lambda: OPT.SGD(learning_rate=0.1), lr=None), 'SGD.lr'),
    'wd-string': (_altered(lambda: OPT.SGD(learning_rate=0.1), wd='0'), 'SGD.wd'),
    'rescale-list': (_altered(lambda: OPT.SGD(learning_rate=0.1), rescale_grad=[1]), 'SGD.rescale_grad'),
    'clip-nan': (_altered(lambda: OPT.SGD(learning_rate=0.1), clip_gradient=float('nan')), 'clip_gradient'),
    'momentum-nan': (_altered(lambda: OPT.SGD(learning_rate=0.1, momentum=0.9), momentum=float('nan')),
                     'SGD.momentum'),
    'num-update-negative': (_altered(lambda: OPT.SGD(learning_rate=0.1), num_update=-5), 'num_update'),
    'num-update-float': (_altered(lambda: OPT.SGD(learning_rate=0.1), begin_num_update=1.5), 'begin_num_update'),
    'count-huge': (_altered(lambda: OPT.SGD(learning_rate=0.1), _all_index_update_counts={0: {3: 2 ** 60}}),
                   '_all_index_update_counts'),
    'lr-mult-string': (_altered(lambda: OPT.SGD(learning_rate=0.1), lr_mult={0: 'x'}), 'lr_mult'),
    'wd-mult-not-dict': (_altered(lambda: OPT.SGD(learning_rate=0.1), wd_mult=[1.0]), 'wd_mult'),
    'idx2name-values': (_altered(lambda: OPT.SGD(learning_rate=0.1), idx2name={0: 5}), 'idx2name'),
    'adam-beta1-one': (_altered(lambda: OPT.Adam(), beta1=1.0), 'Adam.beta1'),
    'adam-beta2-above-one': (_altered(lambda: OPT.Adam(), beta2=1.5), 'Adam.beta2'),
    'adam-epsilon-string': (_altered(lambda: OPT.Adam(), epsilon='1e-8'), 'Adam.epsilon'),
    'rmsprop-clip-weights-nan': (_altered(lambda: OPT.RMSProp(), clip_weights=float('nan')), 'clip_weights'),
    'rmsprop-centered-string': (_altered(lambda: OPT.RMSProp(), centered='yes'), 'centered'),
    'ftrl-beta-inf': (_altered(lambda: OPT.Ftrl(), beta=float('-inf')), 'Ftrl.beta'),
    'adagrad-eps-none': (_altered(lambda: OPT.AdaGrad(), float_stable_eps=None), 'float_stable_eps'),
    'signum-wd-lh-nan': (_altered(lambda: OPT.Signum(), wd_lh=float('nan')), 'Signum.wd_lh'),
}


@pytest.mark.parametrize('case', sorted(UNUSABLE))
def test_unusable_fields_are_refused_when_the_pickle_arrives(case):
    make, field = UNUSABLE[case]
    with pytest.raises(optimizers.UnusableOptimizerError, match='refused') as info:
        load_optimizer(pickle.dumps(make(), 0))
    assert field in str(info.value)


@pytest.mark.parametrize('make', [
    lambda: OPT.SGD(learning_rate=-0.1, wd=-1e-3, rescale_grad=-2.0, clip_gradient=-1.0),   # odd but computable
    lambda: OPT.SGD(lr_scheduler=LRS.FactorScheduler(step=1, factor=1.0)),
    lambda: OPT.SGD(lr_scheduler=LRS.FactorScheduler(step=3, factor=0.0, warmup_steps=5, warmup_mode='constant')),
    lambda: OPT.SGD(lr_scheduler=LRS.PolyScheduler(max_update=10, base_lr=0.1, pwr=0, warmup_steps=9)),
    lambda: OPT.Adam(beta1=0.0, beta2=1.0),
    lambda: OPT.RMSProp(centered=True, clip_weights=0.5),
    lambda: OPT.SGD(learning_rate=0.1, begin_num_update=10 ** 6,
                    lr_scheduler=LRS.FactorScheduler(step=1, factor=0.999999)),   # a long (bounded) resume
])
def test_usable_edge_values_are_accepted(make):
    opt = load_optimizer(pickle.dumps(make(), 0))
    w = np.ones(3, np.float32)
    opt.update(0, w, np.ones(3, np.float32), opt.init_states(w))


def test_a_bounded_factor_scheduler_still_matches_mxnet():
    """The bound only refuses what would loop for more than MAX_SCHEDULER_STEPS: a resumed job whose count is
    100000 steps behind gets MXNet's lr, to the bit."""
    ref = LRS.FactorScheduler(step=1, factor=0.99999, stop_factor_lr=1e-9, base_lr=0.5)
    ours = load_optimizer(pickle.dumps(OPT.SGD(learning_rate=0.5, lr_scheduler=LRS.FactorScheduler(
        step=1, factor=0.99999, stop_factor_lr=1e-9, base_lr=0.5)), 0)).lr_scheduler
    for num_update in (100_000, 100_001, 100_500):
        assert ours(num_update) == ref(num_update)


def test_restored_update_counts_are_checked():
    opt = load_optimizer(pickle.dumps(OPT.SGD(learning_rate=0.1, lr_scheduler=LRS.FactorScheduler(
        step=1, factor=0.5)), 0))
    opt.restore_count(3, 40, 50)
    assert opt._index_update_count[3] == 40 and opt.num_update == 50
    for count, num_update, why in [(-1, 0, 'count'), (0, 2 ** 60, 'num_update'), (1.5, 0, 'count'),
                                   (0, 10 ** 9, 'FactorScheduler')]:   # 10^9 steps of 1 past the count
        with pytest.raises(optimizers.UnusableOptimizerError, match=why):
            opt.restore_count(3, count, num_update)
    assert opt._index_update_count[3] == 40 and opt.num_update == 50   # nothing changed
