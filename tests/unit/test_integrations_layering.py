"""`import unirl` and the padded API import neither TRL nor verl: only the adapters do."""

import subprocess
import sys

CHECK = """
import sys
import unirl, unirl.losses, unirl.integrations, unirl.core.step
loaded = sorted({m.split('.')[0] for m in sys.modules} & {'trl', 'verl', 'ray', 'datasets'})
assert not loaded, loaded
"""


def test_unirl_and_unirl_losses_import_no_framework():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
