"""The seeds' claims, one module per family, each checked on Fashion-MNIST by ``bench/seed_claims.py``.

Every module here exposes::

    def rows(seeds: list[int], quick: bool) -> list[dict]

one dict per claim with the keys ``claim`` (what the paper says), ``source`` (seed and table),
``paper`` (the paper's figure), ``ours`` (our figure on Fashion-MNIST, mean ± std over
``seeds``), ``holds`` (True, False or a short qualifier such as "partly") and ``why`` (what
explains our result). ``quick`` asks for a fast path (fewer rounds, smaller grids) for a smoke run.
"""

ROW_KEYS = ("claim", "source", "paper", "ours", "holds", "why")
