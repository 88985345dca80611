"""The lab runs on machines without torch: importing and running it never imports torch."""

import subprocess
import sys


def test_the_lab_imports_no_torch():
    code = ("import sys; from iterserve.cli import main; "
            "rc = main(['lab', '--requests', '4', '--json']); "
            "rc = rc or main(['lab', 'spec', '--slots', '1', '--acceptance', '0.5', "
            "'--requests', '4', '--json']); "
            "import iterserve.lab.trace, iterserve.lab.plot; "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
