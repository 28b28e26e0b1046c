"""``cached diagnose``: is training input-bound on this dataset, and what should change?

It talks to the running daemon over its socket, as any user on the node would (no store
credentials), and measures, within a time budget:

- the **store**: cold shards of the dataset opened through the daemon, a few at a time
  (as its prefetcher fetches them), bytes per second from first request to last arrival;
- the **hot tier and transport**: resident shards read through the daemon by ``workers``
  reader processes at once (as DataLoader workers read them), and the shard files read
  raw from the hot tier's directory when this user may read it, which tells a slow disk
  (``hot_tier``) from a slow hop (``transport``);
- **decode**: the ``--decode`` function applied to real samples in one process;
- **the loader**: where torch is installed, a real DataLoader over ``CachedDataset`` with
  ``workers`` (then twice as many) workers, the batch size and the decode function, over
  resident shards: how many samples per second its workers deliver, how long an epoch's
  first batch takes, and how long the training process spends taking one batch from the
  workers (collation, pickling, shared memory: a hop of the transport);
- **the fast path**: one process receiving the same shards in place, as ``FastLoader``
  does.

A pure model (:func:`.model.predict`, numbers in, numbers out) turns those rates, the step
time and the dataset's residency into the share of loop time waiting for data over the next
epoch, names the bottleneck (``store``, ``hot_tier``, ``transport``, ``decode`` or
``none``) and predicts each lever: more workers, a larger lookahead, a hot tier that holds
the dataset, the fast path. docs/observability.md ("Diagnosing one dataset") has the
formulas and how well they predict a real run.

The rooms, data flowing one way: :mod:`.measure` runs the measurements (:mod:`.store`:
the store and the residency; :mod:`.rates`: reads, disk, decode, loader, fast path) into
``Measurements`` (:mod:`.measurements`, plain data); :mod:`.model` turns them into a
``Prediction`` (``predict``); :mod:`.report` prints it; :mod:`.run` is the command, from end
to end (``cached diagnose`` in the daemon's CLI calls ``run.run``). ``python -m
cached_client.diagnose --worker`` (:mod:`.__main__`) is the reader process of the transport
measurement. :mod:`.units`: how sizes, rates and times read.

Why a daemon gave no handshake (:func:`explain_unreachable`) lives a floor below, in
:mod:`cached_client.endpoint`, which the transport imports; it is re-exported here for
callers that took it from this package. So importing this package stays cheap: it imports
that room alone, and the measurement's rooms are imported by their module (``from
cached_client.diagnose.run import run``); none of them imports torch or numpy at import
time. They are not re-exported lazily either: ``measure``, ``report`` and ``run`` are each a
module's name and its function's, and a submodule imported first would shadow its function
here.
"""

from ..endpoint import explain_unreachable

__all__ = ["explain_unreachable"]
