"""RPC: typed calls over one session -- envelopes, chunked bodies, interfaces, the idempotency
table, hooks, resources and the per-session :class:`~garcon_link.rpc.rpc.ExecutorRpc`.

Imports the rooms below it (ground to endpoint).
"""
