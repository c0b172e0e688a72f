"""The bytes between processes: message encoding, reservation keys, CURVE-authenticated sockets.

Runs in every process of the runtime (client, host agent, proc; a rank only through its agent).
Its own package because it is the floor everything else stands on: it imports nothing above it,
and whoever holds the keys it defines can make the runtime run code.
"""
