"""Low-level runtime shared by the layers above: devices and streams, CUDA graph capture
state, the update stream, table memory, progress bars and the trainer callbacks' base class.

- :mod:`veloce.runtime.device`: streams, host copies, host tensors.
- :mod:`veloce.runtime.capture`: the state of a CUDA graph capture of a step.
- :mod:`veloce.runtime.update_stream`: sparse updates on a side stream beside the inserts.
- :mod:`veloce.runtime.memory`: allocation of a table's buffers.
- :mod:`veloce.runtime.progress`: a terminal progress bar.
- :mod:`veloce.runtime.hooks`: the base class of trainer callbacks.
"""
