"""Starting host agents: the agent's command line (built by clients, parsed by the agent) and local starts.

Runs in the client: every backend builds the agent's command with :class:`.command.AgentCommand`,
and :mod:`.start` starts agents on this machine with the keys on their stdin (the local backend,
a Slurm node's step, a controller's ``this_host()``). The agent imports only :func:`.command.parser`,
so client and agent cannot disagree. Its own package because it is the client's side of the
agent, and it must stay light: it loads neither ZeroMQ nor the agent's code.
"""
