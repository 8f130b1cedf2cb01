"""Training a model with :class:`veloce.DynamicEmbedding` tables: the :class:`Trainer` and
its callbacks, the config of ``veloce train`` and building a model, its data and its
Trainer from one.

Modules:
    - :mod:`~veloce.train.trainer`: the :class:`Trainer` (its loop, evaluation and
      logging); its ``cuda_graph`` steps in :mod:`~veloce.train.graphed`, its
      checkpoints and resume in :mod:`~veloce.train.resume`, its epoch totals in
      :mod:`~veloce.train.totals`, its metrics in :mod:`~veloce.train.evaluation`, Ctrl-C in
      :mod:`~veloce.train.interrupt`, its argument checks in :mod:`~veloce.train.arguments`.
    - :mod:`~veloce.train.callbacks`: the hooks, early stopping and the built-in loggers.
    - :mod:`~veloce.train.lockstep`: the batch conventions, RNG state, and keeping ranks with
      different numbers of batches in step.
    - :mod:`~veloce.train.config`: the YAML config's schema and loading.
    - :mod:`~veloce.train.build`: the model, loaders and Trainer of a config.
"""

from veloce.train import build, callbacks, config, lockstep
from veloce.train.build import build_loaders, build_model, build_trainer
from veloce.train.callbacks import Callback, EarlyStopping
from veloce.train.config import Config, ConfigError, load_config
from veloce.train.interrupt import TrainingInterrupted
from veloce.train.trainer import Trainer

__all__ = [
    "Callback", "Config", "ConfigError", "EarlyStopping", "Trainer", "TrainingInterrupted",
    "build_loaders", "build_model", "build_trainer", "load_config",
    "build", "callbacks", "config", "lockstep",
]  # fmt: skip
