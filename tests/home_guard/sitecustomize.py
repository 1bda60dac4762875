"""Imported at start-up by every Python process a test starts (tests/conftest.py puts this
folder on PYTHONPATH): installs the real-home write guard of home_audit.py, then runs the
sitecustomize this one shadows, if there is one."""
import os
import sys
from importlib.machinery import PathFinder

import home_audit

home_audit.install_from_env()

_here = os.path.dirname(os.path.abspath(__file__))
_next = PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(sys.modules[__name__])
