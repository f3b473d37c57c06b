"""What the device adds to a step, for every engine: the totals a step reaches on a card
(``totals``: cuBLAS workspaces, allocator reserve, CUDA context, NCCL), the caching allocator
(``allocator``), CUDA kernels' memory emulated in a CPU dry run (``kernels``), and advice on a
setup for its GPU (``advice``)."""
