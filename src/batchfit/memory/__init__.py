"""Memory estimation engines: ``analytic`` (formulas) and ``trace`` (a fake-tensor dry run of
the step), behind one entry point, :func:`batchfit.memory.estimate.estimate`."""
