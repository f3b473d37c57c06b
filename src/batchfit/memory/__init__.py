"""Memory estimation engines behind one entry point, :func:`batchfit.memory.estimate.estimate`.

- ``formulas/``: the analytic engine, every component from formulas, without torch.
- ``trace/``: the trace engine, a fake-tensor dry run of the real step (FSDP2 under a fake
  process group included).
- ``device/``: what the device adds, shared by both: CUDA kernels' memory, the caching
  allocator, cuBLAS, CUDA context and NCCL totals.

Shared by all: the values (``types``), the entry point and its input checks (``estimate``), and
the largest micro-batch under a budget (``fit``).
"""
