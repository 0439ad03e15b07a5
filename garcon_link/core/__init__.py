"""Core, sans-IO: the wire format, the message session, the handshake, and the decisions the
endpoint obeys (admission, the heartbeat step, the replay watch).

Bytes and values in, bytes and values out: no sockets, no clock, no anyio. Imports only ground.
"""
