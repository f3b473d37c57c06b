import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Dry-run results are cached on disk: one fresh cache per test run, never the user's.
if "BATCHFIT_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["BATCHFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="batchfit-test-cache-")
