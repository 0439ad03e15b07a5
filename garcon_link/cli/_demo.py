"""``garcon-link demo``: the narrated loopback story of :mod:`garcon_link.demo`."""

from __future__ import annotations

import argparse

from ._output import _setup_logging


def _cmd_demo(ns: argparse.Namespace) -> int:
    from ..demo import run_demo

    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    return run_demo(verbose=ns.verbose)
