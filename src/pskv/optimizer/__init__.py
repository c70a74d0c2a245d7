"""``pskv.optimizer``: MXNet 1.9.1's optimizers, registry and KVStore updater.

Examples
--------
>>> import pskv
>>> opt = pskv.optimizer.create('adam', learning_rate=0.01, wd=1e-4)
>>> updater = pskv.optimizer.get_updater(opt)
>>> w = pskv.nd.ones((2, 2))
>>> updater('w0', pskv.nd.ones((2, 2)), w)
>>> round(float(w.asnumpy()[0, 0]), 4)
0.99
"""
from __future__ import annotations

from .adadelta import AdaDelta
from .adagrad import AdaGrad
from .adam import Adam
from .base import (LearningRateError, Optimizer, UnknownArgumentError, create, from_spec,
                   register)
from .ftrl import FTRL, Ftrl
from .rmsprop import RMSProp
from .sgd import NAG, SGD, SignSGD, Signum, ccSGD
from .test import Test
from .updater import OptimizerStateError, Updater, get_updater

__all__ = ["AdaDelta", "AdaGrad", "Adam", "FTRL", "Ftrl", "LearningRateError", "NAG",
           "Optimizer", "OptimizerStateError", "RMSProp", "SGD", "SignSGD", "Signum", "Test",
           "UnknownArgumentError", "Updater", "ccSGD", "create", "from_spec", "get_updater",
           "register"]
