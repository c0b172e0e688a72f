"""The per-process messaging endpoint (:class:`.mailbox.Mailbox`), its threads and its futures.

Runs in the client (controller, ``monarch`` commands) and in every proc that calls other actors;
never in the host agent, which answers on a socket of its own. Its own package because it is one
object with three threads (I/O, heartbeats, event routing) that the actor API and the jobs layer
both stand on; :class:`.future.Future` lives here because a mailbox is what resolves it.
"""
