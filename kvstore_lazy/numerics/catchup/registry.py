"""Which optimizers stock runs with dense semantics on a row_sparse weight, and the rule of each.

Owns: :func:`rule_for`, the table of MXNet 1.9.1's choices (python/mxnet/optimizer/optimizer.py and the ops'
storage dispatch in src/operator/optimizer_op.cc), and :func:`rule_named` (a rule by its name, for snapshots):

=================  =====================================================  =======================
optimizer          stock on a row_sparse weight and gradient              rule
=================  =====================================================  =======================
SGD                lazy_update=True: lazy (SGDDnsRspKernel, lazy mom)       none
                   lazy_update=False: every row, momentum or not           SGDDecay / SGDMomentum
NAG, momentum      nag_mom_update has no sparse path: densified            NAGMomentum
NAG, no momentum   sgd_update with its default lazy_update=True: lazy       none
Signum             signum_update / signsgd_update: densified               SignumMomentum / SignSGD
RMSProp            rmsprop[alex]_update: densified                         RMSPropZero / Centered
Adam               lazy_update=True: lazy; False: AdamStd kernel           none / AdamStd
AdaGrad, Ftrl      no lazy_update flag: always the sparse (lazy) kernel     none
=================  =====================================================  =======================

Does not own: the rules' arithmetic (``sgd_family.py``, ``adaptive.py``).
"""
from __future__ import annotations

from kvstore_lazy.numerics.catchup.adaptive import AdamStd, RMSPropCentered, RMSPropZero
from kvstore_lazy.numerics.catchup.base import ZeroRule
from kvstore_lazy.numerics.catchup.sgd_family import NAGMomentum, SGDDecay, SGDMomentum, SignSGD, SignumMomentum
from kvstore_lazy.numerics.optimizers import NAG, SGD, Adam, Optimizer, RMSProp, Signum


def dense_semantics(opt: Optimizer) -> bool:
    """Whether stock moves the rows without gradient of a row_sparse key under this optimizer."""
    return rule_for(opt) is not None


RULES: dict[str, type[ZeroRule]] = {r.name: r for r in (SGDDecay, SGDMomentum, NAGMomentum, SignumMomentum, SignSGD,
                                                       RMSPropZero, RMSPropCentered, AdamStd)}


def rule_named(name: str) -> ZeroRule:
    """The rule called `name` (a snapshot's); ValueError for any other name."""
    if name not in RULES:
        raise ValueError(f"unknown zero-gradient rule {name!r} (known: {', '.join(sorted(RULES))})")
    return RULES[name]()


def rule_for(opt: Optimizer) -> ZeroRule | None:
    """The zero-gradient rule of `opt` (None: stock is lazy, rows without gradient keep their values)."""
    lazy = bool(getattr(opt, 'lazy_update', True))
    if isinstance(opt, SGD):
        if lazy:
            return None
        return SGDMomentum() if opt.num_states() else SGDDecay()
    if isinstance(opt, NAG):
        return NAGMomentum() if opt.num_states() else None
    if isinstance(opt, Signum):
        return SignumMomentum() if opt.num_states() else SignSGD()
    if isinstance(opt, RMSProp):
        return RMSPropCentered() if opt.centered else RMSPropZero()
    if isinstance(opt, Adam):
        return None if lazy else AdamStd()
    return None
