"""Endpoint: one authenticated, resumable session per executor over WebSocket sockets.

The transport (replay fence, inbound buffer) and the link (accept and dial loops, handshake
driver, heartbeats). Imports ground, core, net and settings.
"""
