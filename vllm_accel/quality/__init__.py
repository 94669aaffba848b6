"""Quality harness shared by every feature benchmark.

* :mod:`.needle` — needle-in-a-haystack over Paul Graham's essays at many depths and lengths;
* :mod:`.retrieval` — RULER-style multi-key and multi-value retrieval;
* :mod:`.perplexity` — perplexity on held-out prose (essays never used as haystack);
* :mod:`.identity` — greedy token identity between two runs (lossless features).

Prompts are built here as token ids (deterministic seeds) and scored here; the engine only
generates. All data comes from PyPI wheels (:mod:`.data`), cached offline after first use.
"""
