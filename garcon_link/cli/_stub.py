"""``garcon-link stub MODULE:ATTR [--sync]``: an interface's Protocol as source, imports included.

The interface is imported (the current directory is importable, as for ``worker --service``) and
its spec derived as a worker would (:func:`~garcon_link.rpc.interface.service_spec`); the printed
module declares the same contract (:func:`~garcon_link.rpc.views.view_source`), so a sync
client accepts ``--sync``'s view against a worker serving the interface.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..rpc.interface import service_spec
from ..rpc.views import view_source
from ._exits import EXIT_OK, UsageError
from ._worker import import_attribute


def _import_interface(text: str) -> type:
    """Parse ``module:attr`` and import the class it names.

    Raises:
        UsageError: malformed, not importable, no such attribute, or not a class.
    """
    module_name, colon, attr = text.partition(":")
    if not colon or not module_name or not attr:
        raise UsageError(f"{text!r}: expected MODULE:ATTR, e.g. mypkg.calc:Calc")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    obj = import_attribute(module_name, attr, repr(text))
    if not isinstance(obj, type):
        raise UsageError(f"{text!r}: {attr} is not a class (an interface is a class)")
    return obj


def _cmd_stub(ns: argparse.Namespace) -> int:
    interface = _import_interface(ns.target)
    print(view_source(service_spec(interface), sync=ns.sync), end="", flush=True)
    return EXIT_OK
