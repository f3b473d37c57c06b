"""Framework integrations; each module imports its framework, so import the one you use.

- ``batchfit.integrations.lightning``: ``MicroBatchCallback`` (sets the micro-batch at fit
  start and keeps the global batch), ``trainer_kwargs(plan)``.
- ``batchfit.integrations.hf``: ``PeakMemoryCallback`` (peak memory and throughput per step,
  a warning when the run drifts from its plan), ``training_arguments(plan)``.
- ``batchfit.integrations.deepspeed``: ``DeepSpeedMicroBatcher`` (OOM recovery for an engine
  that owns its accumulation: every rank shrinks together, ``train_batch_size`` is kept).
"""
