"""Shared set-up of the rdplot tests: the python3 that has matplotlib, and rdplot itself."""
import importlib.util
import os
import subprocess
import sys


def run_where_matplotlib_is():
    """Re-runs this test under Debian's /usr/bin/python3 when the python3 that started it
    (pyenv, a virtual environment) lacks matplotlib and that one has it, so it draws too."""
    system = "/usr/bin/python3"
    if (importlib.util.find_spec("matplotlib") is None and os.path.exists(system)
            and os.path.realpath(sys.executable) != os.path.realpath(system)
            and subprocess.run([system, "-c", "import matplotlib"],
                               capture_output=True).returncode == 0):
        os.execv(system, [system, *sys.argv])


def load_rdplot(path):
    """tools/rdplot.py as a module, from its path."""
    spec = importlib.util.spec_from_file_location("rdplot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
