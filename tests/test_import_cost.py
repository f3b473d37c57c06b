"""``import batchfit`` stays cheap: importlib.metadata loads only when versions are asked for."""

import subprocess
import sys


def test_import_batchfit_does_not_load_importlib_metadata():
    # importlib.metadata was most of `import batchfit` : only versions() needs it.
    code = (
        "import sys, batchfit\n"
        "assert 'importlib.metadata' not in sys.modules, 'importlib.metadata imported'\n"
        "print(batchfit.__version__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_versions_still_reads_installed_distributions():
    from batchfit._version import versions

    found = versions()
    assert found["batchfit"] and found["torch"]
