"""``stages.Sampler``: the next-token choice, configured per request (``conf/sampler/``).

It lives with the rest of sampling in ``pipeline.sampling.sampler``; this name stays for imports
written against the stage (``from stages.sampler import Sampler``).
"""

from pipeline.sampling.sampler import Sampler

__all__ = ["Sampler"]
