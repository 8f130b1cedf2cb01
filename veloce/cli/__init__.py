"""The ``veloce`` command: train and evaluate from a YAML config, inspect checkpoints.

    veloce train configs/dlrm_synthetic.yaml [--set trainer.max_epochs=2 ...]
    veloce evaluate configs/dlrm_synthetic.yaml --checkpoint runs/dlrm_synthetic/checkpoints
    veloce inspect runs/dlrm_synthetic/checkpoints/step_000000489 [--json] [--verify]
    veloce train configs/dlrm_criteo.yaml --launcher torchrun --workers 2      # several ranks
    veloce train configs/dlrm_criteo.yaml --launcher ray --workers 4           # on Ray Train

The config's fields are documented in ``docs/config.md`` (schema: :mod:`veloce.train.config`);
the launchers in ``docs/scaling.md`` (code: :mod:`veloce.cli.launch`).

Errors the user can act on (config, options, a run directory holding a finished run, a
checkpoint, a data file) print one line naming the field, file or line, without a
traceback (``--traceback`` or ``VELOCE_TRACEBACK=1`` shows it). Exit status: 0 on success,
1 on a runtime, checkpoint or data error or a validation metric that computed to NaN
(``veloce.metrics.MetricError``), 2 on a config or option error (a finished run directory
included), 130 after Ctrl-C (the step reached is checkpointed), 141 when the reader of the
output went away (``veloce inspect ... | head``); torchrun's own status when it launches.
"""

from veloce.cli.commands import main
from veloce.cli.run import train

__all__ = ["main", "train"]
