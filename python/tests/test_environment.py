"""What importing pinstream does to the process's environment: CUDA_DEVICE_MAX_CONNECTIONS
defaults to 32 where unset, and a value set before the import is kept, whether in os.environ or
only in the C environment (no GPU needed: only the variable is checked, in a fresh
interpreter)."""

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


def test_a_value_only_in_the_c_environment_is_kept():
    """`os.putenv` (or a native `setenv`) changes the C environment and not `os.environ`: the
    value CUDA would read must still be the caller's."""
    code = (
        "import ctypes, os; os.putenv('CUDA_DEVICE_MAX_CONNECTIONS', '1'); import pinstream; "
        "g = ctypes.CDLL(None).getenv; g.restype = ctypes.c_char_p; "
        "print(g(b'CUDA_DEVICE_MAX_CONNECTIONS').decode())"
    )
    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_the_default_is_set_before_the_extension_loads():
    """The variable is set at the top of the package, before `_native` (which links the CUDA
    runtime) is imported."""
    import pathlib

    import pinstream

    text = pathlib.Path(pinstream.__file__).read_text()
    assert text.index("_CONNECTIONS] = \"32\"") < text.index("from ._native import")
