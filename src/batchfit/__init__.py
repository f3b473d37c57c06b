"""batchfit: what a training step needs, the fastest micro-batch, and exact accumulation."""
