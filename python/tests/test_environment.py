"""What importing pinstream does to the process's environment: CUDA_DEVICE_MAX_CONNECTIONS
defaults to 32 where unset, and an explicit value is kept (no GPU needed: only the variable is
checked, in a fresh interpreter)."""

import os
import subprocess
import sys

import pytest

SHOW = "import os, pinstream; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))"


def _after_import(value):
    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if value is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = value
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_unset_connections_become_32():
    assert _after_import(None) == "32"


@pytest.mark.parametrize("value", ["1", "8", "32", ""])
def test_an_explicit_value_is_kept(value):
    assert _after_import(value) == value
