"""The host agent: one long-lived process per host, its request handlers, its warm processes.

Runs on each host of a reservation (``python -m monarch_cli.runtime.agent``): :mod:`.host` is the
agent's core (its socket, its loop, supervision of clients); :mod:`.procs`, :mod:`.ranks`,
:mod:`.debug`, :mod:`.sync`, :mod:`.telemetry` handle requests and see the agent only through
:class:`.core.AgentCore`; :mod:`.warm` keeps the fork servers, and :mod:`.zygote` is the main of
those warm processes (a child of the agent). :mod:`.registry` is also read by the local backend
(client) to find a reservation's agents. This ``__init__`` imports nothing, so the zygote and
the registry's readers do not pay for the agent.
"""
