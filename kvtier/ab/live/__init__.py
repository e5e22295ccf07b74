"""The live part of the A/B harness: real vLLM stacks, the router, the indexer.

- ``cli``: the arguments of ``kvtier ab``, ``ab-report``, ``calibrate`` and ``demo``;
  each command lives in ``ab`` (ab, ab-report), ``calibrate`` and ``demo``, with what they
  share in ``common``; ``regen``: ``ab-report --all``, every committed report regenerated
  from its raw JSON.
- ``sweep``: every strategy in turn, faults recorded; ``runner``: one strategy's live run, on
  the stack ``stacks`` deploys or one already running (``running``: ``kvtier ab --stack``),
  each turn measured by ``measure``.
- ``kvtier.wire.reuse_headers`` reads the router's reuse decision; ``scrape``: Prometheus
  pages; ``lock``: the machine-wide lock every local stack runs under (tests included).

Threading model: see each module.
"""
