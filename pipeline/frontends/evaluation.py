"""lm-evaluation-harness on the engine: an ``lm_eval`` ``LM`` whose requests run in-process.

Why an adapter over the engine rather than lm-eval's own ``hf`` model: every request of a task
is queued at once (continuous batching over the paged pool, no padding); a question's choices
score only their continuation, so the question's context is computed once, by its first choice,
and the others take it from the prefix cache; only the rows that score become log-probabilities.
The figures are the same as ``HFLM``'s: texts are encoded as it encodes them, and each score is
the sum of ``log_softmax`` of the model's logits at the continuation's positions.

    from lm_eval import simple_evaluate
    from pipeline.frontends.evaluation import EngineLM

    results = simple_evaluate(model=EngineLM(pipe), tasks=["arc_easy"], limit=100)

Generation (``generate_until``) runs the whole chain: a prompt rendered by ``apply_chat_template``
(lm-eval's ``apply_chat_template=True``) and every prompt with images or audio (lm-eval's
multimodal tasks, ``<image>`` placeholders) go through the Tokenize stage as messages, so the
model's own template places the media; other prompts are fed as lm-eval's text, encoded.
"""

from __future__ import annotations

import sys
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from accelerate.utils import gather
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from pipeline.context import Context, Request
from pipeline.errors import UserError
from pipeline.memory import text_config
from pipeline.pipeline import Pipeline
from stages.sampler import Sampler

IMAGE_PLACEHOLDER = "<image>"  # lm-eval's own (lm_eval.models.hf_vlms.DEFAULT_IMAGE_PLACEHOLDER)
# lm-eval generation settings and the Sampler argument each becomes; any other is refused.
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
}
DEFAULT_MAX_GEN_TOKS = 256  # HFLM's


@dataclass
class Job:
    """One engine request of an evaluation: raw ids, or (``ids`` None) a request the chain renders."""

    key: int
    request: Request
    ids: list[int] | None = None

    @property
    def item(self) -> tuple:
        """As ``Pipeline.run_many`` takes it."""
        return self.key, self.request, self.ids


class EngineLM(TemplateLM):
    """lm-eval's ``LM`` interface over a ``Pipeline``: ``loglikelihood``, ``loglikelihood_rolling``
    and ``generate_until`` (text, images and audio), batched through its engine.

    ``max_length``: the context a request may use (default: the model's); longer inputs keep their
    end, as ``HFLM`` does. ``thinking``: passed to templates that take ``enable_thinking``.
    ``process``: accelerate's ``PartialState`` of a data-parallel launch: lm-eval gives each
    process its share of the documents and gathers the results on the first.
    """

    MULTIMODAL = True  # lm-eval hands image tasks only to models that say so

    def __init__(
        self,
        pipe: Pipeline,
        *,
        max_length: int | None = None,
        thinking: bool | None = None,
        progress: bool = True,
        process: Any = None,
        adapter: str | None = None,
    ) -> None:
        super().__init__()
        self.adapter = None if adapter is None else pipe.lm.adapters.get(adapter).name  # every request's
        self.process = process
        if process is not None:
            self._rank, self._world_size = process.process_index, process.num_processes
        self.pipe = pipe
        self.scorer = pipe.with_stages({k: v for k, v in pipe.stages.items() if k != "decode"})
        self.tokenizer = pipe.lm.tokenizer
        self._max_length = max_length or getattr(text_config(pipe.lm.config), "max_position_embeddings", None) or 2048
        self.thinking = thinking
        self.progress = progress
        self._chats: dict[str, list[dict]] = {}  # what apply_chat_template rendered -> its messages

    # --- what lm-eval asks of a model ------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS where the tokenizer has one (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """``HFLM.tok_encode``: the tokenizer's own special tokens, unless the text already starts
        with the prefix token (a rendered chat template)."""
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **options)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The model's template over lm-eval's messages (``<image>`` placeholders become image
        entries); generation then sends the messages themselves through the chain."""
        lm = self.pipe.lm
        messages = [_message(m, lm.family) for m in chat_history]
        owner = lm.template_owner
        extra = {} if self.thinking is None else {"enable_thinking": self.thinking}
        text = owner.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
            **extra,
        )
        if add_generation_prompt:
            self._chats[text] = messages
        return text

    # --- several processes (lm-eval's hooks, as its HFLM implements them) ------------------------
    @property
    def device(self) -> Any:
        return self.pipe.lm.device

    def all_gather(self, tensor: Any) -> Any:
        if self.world_size == 1:
            return tensor
        group = getattr(self.process, "group", None)  # tensor-parallel groups' rank 0s; None: accelerate's
        if group is None:
            return gather(tensor)
        local = (
            tensor.cpu().reshape(-1) if tensor.dim() == 0 else tensor.cpu()
        )  # gloo's group; scalars as accelerate's gather
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, local, group=group)
        return torch.cat(parts).to(tensor.device)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, group=getattr(self.process, "group", None), group_dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            self.process.wait_for_everyone()

    # --- scoring --------------------------------------------------------------------------------
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Each continuation's summed log-probability and whether every token of it was the most
        likely one. Requests with the same context run as a group: the first, then the rest."""
        groups: dict[tuple[int, ...], list[Job]] = {}
        for key, (_, context, continuation) in enumerate(requests):
            whole = (context + continuation)[-self.max_length :]
            start = max(1, len(whole) - len(continuation))
            job = Job(key, Request(prompt_logprobs=1, prompt_logprobs_from=start, adapter=self.adapter), whole)
            groups.setdefault(tuple(whole[:start]), []).append(job)
        done = self._run(self.scorer, groups.values(), "loglikelihood", disable_tqdm)
        answers = [_score(done[key], len(requests[key][2])) for key in range(len(requests))]
        for (pair, _, _), answer in zip(requests, answers):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-probability, in disjoint windows of at most ``max_length`` tokens
        (lm-eval's own windowing, as HFLM)."""
        windows, owners = [], []
        for n, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (value, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[n] += value
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # --- generation -----------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's text up to the first of its ``until`` strings (or EOS, or ``max_gen_toks``)."""
        jobs = [self._generation(key, *request.args) for key, request in enumerate(requests)]
        done = self._run(self.pipe, [[job] for job in jobs], "generate_until", disable_tqdm)
        answers = [done[key].text for key in range(len(requests))]
        for request, answer in zip(requests, answers):
            self.cache_hook.add_partial("generate_until", request.args[:2], answer)
        return answers

    def _generation(self, key: int, context: str, gen_kwargs: dict, media: dict | None = None) -> Job:
        settings = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        eos = self.tokenizer.decode([self.eot_token_id])
        until = handle_stop_sequences(settings.pop("until", None), eos=eos)
        steps = int(settings.pop("max_gen_toks"))
        sampler = _sampler(settings)
        request = Request(
            max_new_tokens=steps, stop=until, sampler=sampler, thinking=self.thinking, adapter=self.adapter
        )
        request.images = list((media or {}).get("visual") or [])
        request.audios = [
            (a["array"], a["sampling_rate"]) if isinstance(a, dict) else a for a in (media or {}).get("audio") or []
        ]
        if context in self._chats:  # rendered by apply_chat_template: the chain renders the same messages
            request.messages = self._chats[context]
        elif request.images or request.audios:  # the model's template places the media, then the text
            request.prompt = context.replace(IMAGE_PLACEHOLDER, "").strip()
        else:
            return Job(key, request, self.tok_encode(context)[-max(1, self.max_length - steps) :])
        return Job(key, request)

    # --- running --------------------------------------------------------------------------------
    def _run(self, pipe: Pipeline, groups: Iterable[list[Job]], what: str, quiet: bool) -> dict[int, Context]:
        """Every job through ``Pipeline.run_many``: a group's first job, then (once it ended, its
        prompt in the prefix cache) the rest. A failed job stops the run (the rest are cancelled)
        with its error."""
        groups = list(groups)
        rest = {group[0].key: group[1:] for group in groups}
        outcomes = pipe.run_many(
            (group[0].item for group in groups), result=False, after=lambda key: [job.item for job in rest.get(key, ())]
        )
        done: dict[int, Context] = {}
        with (
            tqdm(
                total=sum(map(len, groups)),
                desc=what,
                unit="req",
                file=sys.stderr,
                dynamic_ncols=True,
                disable=quiet or not self.progress,
            ) as bar,
            closing(outcomes),
        ):
            for key, outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
                done[key] = outcome
                bar.update(1)
        return done


def _score(ctx: Context, length: int) -> tuple[float, bool]:
    """The continuation's (last ``length`` prompt tokens') log-probability, and whether each of
    its tokens was the most likely there (a tie counts as most likely)."""
    entries = [ctx.prompt_logprobs[p] for p in sorted(ctx.prompt_logprobs)][-length:] if length else []
    return sum(e.logprob for e in entries), all(e.logprob >= e.top[0][1] for e in entries)


def _sampler(settings: dict) -> Sampler | None:
    """lm-eval's generation settings as a Sampler (None: greedy, the chain's own choice is not used)."""
    sample = bool(settings.pop("do_sample", False))
    unknown = sorted(set(settings) - set(SAMPLING))
    if unknown:
        raise UserError(
            f"lm-eval generation setting(s) {', '.join(unknown)} are not supported "
            f"(supported: do_sample, until, max_gen_toks, {', '.join(SAMPLING)})"
        )
    values = {SAMPLING[k]: v for k, v in settings.items() if v is not None}
    if not sample:
        values["temperature"] = 0.0
    try:
        return Sampler(**values)
    except ValueError as err:
        raise UserError(f"lm-eval generation settings: {err}") from None


def _message(message: dict, family: Any) -> dict:
    """An lm-eval message with ``<image>`` placeholders as the family's content list (images first,
    as lm-eval does without interleaving); plain text stays a string."""
    content = message.get("content")
    if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
        return dict(message)
    text = content.replace(IMAGE_PLACEHOLDER, "").strip()
    return {**message, "content": family.content(text, content.count(IMAGE_PLACEHOLDER), 0)}
