"""The ZeroMQ ROUTER: client requests -> hot tier -> reply frames (protocol v1).

Each payload frame is one member read by ``preadv`` into its own ZeroMQ message
(``pread.read_members``), sent as it is: one copy, from the page cache; a local reader
gets the file and a packed layout instead (``layouts.py``).

Its rooms, one job each (the data flows down the list):

- ``loop``: :class:`Server`, the request loop and its back-pressure, and its lifecycle;
- ``bind``: the endpoint (socket options, the ipc file's mode, a daemon already there);
- ``dispatch``: one request from its frame to its reply (decode, access, op, errors);
- ``reads``: ``open``, ``read``, ``close`` and ``release``;
- ``plans``: ``plan`` and ``dataset``;
- ``sessions``: session names, heartbeats, what a gone connection leaves, the sweep;
- ``holdings``: what clients hold (leases, plans, datasets) and its caps;
- ``sendq``: replies out, and the backlog of those a client's queue cannot take yet;
- ``checks``: each request field, of its type and within its bounds.
"""

from .loop import Server

__all__ = ["Server"]
