"""Memory estimation engines: ``analytic`` (formulas) and, later, ``trace`` (fake-tensor run)."""
