"""Several answers from one shared prefix (a system prompt, an image): MNN's rollback scenario."""
from __future__ import annotations

from typing import Callable, Sequence

from pipeline.context import Request, Result
from pipeline.kv_cache import KVCache
from pipeline.pipeline import Pipeline


def common_prefix_length(pipe: Pipeline, requests: Sequence[Request]) -> int:
    """Tokens (media hashes included) that every request's rendered prompt starts with."""
    keys = [pipe.tokenize(r).token_keys for r in requests]
    n = min(len(k) for k in keys)
    first = keys[0]
    for other in keys[1:]:
        i = 0
        while i < n and other[i] == first[i]:
            i += 1
        n = i
    return n


def run_shared_prefix(
    pipe: Pipeline,
    requests: Sequence[Request],
    cache: KVCache | None = None,
    on_result: Callable[[int, Result], None] | None = None,
) -> list[Result]:
    """Prefill the common prefix once, snapshot it, and answer each request from the snapshot.

    Each answer equals a fresh run of its full prompt; only its own suffix is computed.
    """
    if not requests:
        return []
    cache = cache if cache is not None else pipe.new_cache()
    shared = common_prefix_length(pipe, requests)
    results: list[Result] = []
    snapshot = None
    for i, request in enumerate(requests):
        if snapshot is not None:
            cache.restore(snapshot)
        result = pipe.run(request, cache=cache)
        if snapshot is None:
            cache.rollback(min(shared, cache.length))
            snapshot = cache.snapshot()
        results.append(result)
        if on_result is not None:
            on_result(i, result)
    return results
