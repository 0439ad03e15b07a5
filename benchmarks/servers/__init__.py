"""Benchmark servers, each run as a child process by the harness.

``python -m benchmarks.servers.<name> --port 0`` binds 127.0.0.1, prints ``READY <port>`` on
stdout and serves until its stdin closes (the harness closes it, or dies), it is signalled,
or ``--max-seconds`` pass.  See ``_common.py``.
"""
