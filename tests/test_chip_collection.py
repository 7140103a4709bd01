"""`pytest --chip` imports every test file on a host whose JAX sees one device (a TPU chip): no file
may build a multi-device mesh, or anything else that needs the 8 simulated CPU devices, at import.
Checked here in a child process that sees one CPU device, as the chip host sees one TPU."""

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

IMPORT_EVERY_TEST_FILE = """
import importlib, sys
import jax
jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_platforms", "cpu")
sys.path[:0] = [sys.argv[1], sys.argv[2]]
failed = []
for name in sys.argv[3:]:
    try:
        importlib.import_module("tests." + name)
    except Exception as e:
        failed.append(f"tests/{name}.py: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_test_file_imports_on_a_one_device_host():
    names = sorted(p.stem for p in TESTS.glob("test_*.py"))
    assert len(names) > 50
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERY_TEST_FILE, str(TESTS.parent), str(TESTS), *names],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, "test files that fail to import with one device:\n" + done.stdout + done.stderr[-2000:]
