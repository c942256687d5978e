"""Several answers from one shared prefix (a system prompt, an image): MNN's rollback scenario."""

from __future__ import annotations

from typing import Callable, Sequence

from pipeline.context import Request, Result
from pipeline.errors import UserError
from pipeline.kv import KVCache, shared_prefix_length
from pipeline.pipeline import Pipeline


def common_prefix_length(pipe: Pipeline, requests: Sequence[Request]) -> int:
    """Tokens (media hashes included) that every request's rendered prompt starts with."""
    return shared_prefix_length(*[pipe.tokenize(r).token_keys for r in requests])


def run_shared_prefix(
    pipe: Pipeline,
    requests: Sequence[Request],
    cache: KVCache | None = None,
    on_result: Callable[[int, Result], None] | None = None,
    keys: Sequence[Sequence] | None = None,
    on_error: Callable[[int, UserError], None] | None = None,
) -> list[Result | None]:
    """Prefill the common prefix once, snapshot it, and answer each request from the snapshot.

    Each answer equals a fresh run of its full prompt; only its own suffix is computed. The
    requests must name the same adapter (``Request.adapter``).
    ``keys``: each request's ``token_keys``, when the caller has tokenized them already.
    ``on_error``: report a request's UserError and go on with the others (its result is None);
    without it the error propagates.
    """
    if not requests:
        return []
    if len({r.adapter for r in requests}) > 1:
        raise UserError("requests with different adapters share no prefix (no KV is shared across adapters)")
    cache = cache if cache is not None else pipe.new_cache()
    shared = shared_prefix_length(*keys) if keys is not None else common_prefix_length(pipe, requests)
    cache.checkpoint_at(shared)  # recurrent layers: the state there is what every answer starts from
    results: list[Result] = []
    snapshot = None
    for i, request in enumerate(requests):
        if snapshot is not None:
            cache.restore(snapshot)
        try:
            result = pipe.run(request, cache=cache)
        except UserError as err:
            if on_error is None:
                raise
            cache.trim()  # drop whatever a failed forward wrote past the recorded keys
            results.append(None)
            on_error(i, err)
            continue
        if snapshot is None:
            cache.rollback(min(shared, cache.length))
            snapshot = cache.snapshot()
        results.append(result)
        if on_result is not None:
            on_result(i, result)
    return results
