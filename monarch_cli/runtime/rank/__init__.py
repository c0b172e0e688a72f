"""Inside one rank of an SPMD run: becoming the rank, its debugger, its telemetry, learning its imports.

Runs in the rank process (forked from a warm process, or a fresh interpreter for cold runs),
before and around the user's ``train.py``; :mod:`.preload` also runs in the warm process.
Its own package because nothing here may cost the rank time or imports it does not need:
it never loads ZeroMQ, the mailbox or the agent (the agent imports it, never the reverse).
"""
