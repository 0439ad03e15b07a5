"""Net: WebSocket sockets over TCP (wsproto/h11) and the event-loop backend seam.

The only room that touches sockets and asks which backend (asyncio or trio) runs. Imports
ground and core.
"""
