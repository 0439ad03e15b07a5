"""Core, sans-IO: the wire format, the message session and the handshake.

Bytes and values in, bytes and values out: no sockets, no clock, no anyio. Imports only ground.
"""
