"""cached_wire: what the daemon and its clients say to each other, in one home.

Both ``cached`` (the daemon) and ``cached_client`` import it, and it imports neither
(docs/decisions.md D52). It ships inside the ``cached-client`` distribution, which the
daemon depends on: one C build, one vendored xxHash, one install for either kind of user.

- ``protocol``: protocol v1's ops, error codes, framing and its default socket;
- ``urls``: shard URLs, their checks and brace expansion;
- ``units``: how sizes, rates and times read for people;
- ``catalog``: a dataset's digest and the positions a compact plan names;
- ``layouts``: the packed layout of a local read, made and read;
- ``errors``: what these raise;
- ``_tarscan`` (C, optional): a downloaded shard file's tar index and checksums in one
  pass, for the daemon's hot tier.
"""
