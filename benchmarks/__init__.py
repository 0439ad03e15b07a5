"""Benchmark harness of garcon_link: floors, peers and (later) garcon_link itself.

Run ``python -m benchmarks --help`` (or ``make bench``); see ``benchmarks/README.md``.
"""
