"""The analytic engine: a step's memory from formulas, without torch (``analytic``).

Parameters, gradients and optimizer state (``_params``), sharding and offload (``_sharding``),
DeepSpeed's ZeRO layout (``deepspeed``), activations (``activations``) and the peak among a
step's moments (``_peak``).
"""
