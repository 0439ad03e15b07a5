"""Exhaustive small-scope model checking of the session, resume and takeover protocol.

The explorer walks every interleaving of a small world -- two processes, their session slots,
the sockets between them -- built from the library's real sans-IO objects
(:class:`~garcon_link.core.session.MessageSession`,
:class:`~garcon_link.core.handshake.Handshake` with its resume rule,
:func:`~garcon_link.core.admission.decide`, the transport's
:class:`~garcon_link.endpoint.transport.PreReadinessBuffer`), checks the invariants in every
state and that every state of the healed network can still reach "all delivered and confirmed".

- :mod:`.network`: the world, its actions and the network model;
- :mod:`.invariants`: what must hold in every state, and the liveness goal;
- :mod:`.explorer`: breadth-first search with state merging, the healed-graph check and
  counterexample traces;
- :mod:`.mutations`: the seeded bugs the tests plant in the real code to show the explorer
  finds them;
- :mod:`.controllers`: two controllers on one listening worker (its slots, places and
  evictions), explored the same way, with isolation between the controllers' sessions checked
  in every state.

``python -m tests.model --help`` runs it from the repository root; ``make verify`` runs the
larger bounds, ``tests/test_model.py`` the CI bounds and the seeded bugs.
"""

from .explorer import Counterexample, Result, explore, replay
from .network import CI, VERIFY, Bounds, World

__all__ = ["CI", "VERIFY", "Bounds", "Counterexample", "Result", "World", "explore", "replay"]
