"""ChatSession: a conversation that keeps one KV cache across turns.

Each turn renders the *whole* history with the model's chat template and runs the pipeline on
the session's cache; ``KVCache.reuse`` (in Prefill) keeps the longest prefix the cache already
holds, so a turn computes only its new tokens. Rendering the full history (instead of appending
ids) keeps every answer identical to a fresh greedy run of the same conversation, even where the
template rewrites history (e.g. Qwen3 drops old thinking blocks): reuse simply stops earlier.

    from pipeline.frontends.chat_session import ChatSession
    chat = ChatSession(pipe, max_new_tokens=128)
    chat.attach("photo.jpg")          # media for the next message (multimodal models): images, clips, audio
    print(chat.send("What is in the picture?").text)
    chat.send("And the colours?")
    chat.undo()                       # drop the last exchange: the cache rolls back, no recompute
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from pipeline.context import Request, Result
from pipeline.errors import UserError
from pipeline.kv import KVCache
from pipeline.media import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_VIDEO_FPS,
    DEFAULT_VIDEO_MAX_FRAMES,
    content_hash,
    load_audio,
    load_image,
    load_video,
    media_kind,
)
from pipeline.cli.outputs import append_jsonl
from pipeline.pipeline import Pipeline

MediaKind = Literal["image", "audio", "video"]


@dataclass
class Attachment:
    """A media item waiting for the next message: its loaded data and how the log names it."""

    kind: MediaKind
    data: Any  # RGB PIL image, (mono waveform, sample_rate), or a sampled pipeline.media.Video
    label: str  # the path it came from, or a content hash


@dataclass
class Turn:
    """One finished exchange: the user message as rendered, its media, and the answer."""

    user: str
    message: dict  # {"role": "user", "content": ...} exactly as it goes into the template
    images: list[Any]
    audios: list[Any]
    labels: list[str]
    result: Result
    kept: int  # cache tokens from before this turn that it kept: /undo rolls back to here
    videos: list[Any] = field(default_factory=list)

    @property
    def reply(self) -> dict:
        return {"role": "assistant", "content": self.result.text}


@dataclass
class ChatSession:
    """History of messages plus one KVCache; ``send`` / ``undo`` / ``reset`` keep them in step.

    Generation settings apply to every turn. With ``log_path``, each finished turn (and each
    undo, reset and interrupted turn, as ``event`` lines) is appended to that JSONL file at once.
    """

    pipe: Pipeline
    system_prompt: str | None = None
    max_new_tokens: int = 128
    ignore_eos: bool = False
    stop: Sequence[str] = ()
    thinking: bool | None = None
    log_path: str | Path | None = None
    max_image_pixels: int | None = None  # decompression-bomb guard for attached images (None: media's default)
    video_fps: float | None = None  # frames sampled per second of an attached clip (None: media's default)
    video_max_frames: int | None = None  # at most this many frames per clip (None: media's default)
    constraint: dict = field(default_factory=dict)  # each answer's: Request fields (json_schema=..., regex=...)
    adapter: str | None = None  # the LoRA adapter answering (Request.adapter; None: the base model)
    cache: KVCache = field(init=False)
    turns: list[Turn] = field(init=False, default_factory=list)
    pending: list[Attachment] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if int(self.max_new_tokens) < 1:
            raise UserError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        self.cache = self.pipe.new_cache()

    # --- state --------------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict]:
        """The conversation so far, as chat-template messages (without the system prompt)."""
        out: list[dict] = []
        for turn in self.turns:
            out += [turn.message, turn.reply]
        return out

    @property
    def last(self) -> Result | None:
        """The result of the last turn still in the conversation."""
        return self.turns[-1].result if self.turns else None

    # --- media --------------------------------------------------------------------------------
    def _require(self, kind: str) -> None:
        lm = self.pipe.lm
        if kind not in lm.family.media:
            raise UserError(
                f"{lm.path} is a {lm.family.name} model without {_a(kind)} {kind} encoder: it cannot take {kind} input"
            )

    def attach(self, path: str | os.PathLike, kind: MediaKind | None = None) -> Attachment:
        """Load a media file for the next message. ``kind`` (when given) must match the content.

        Bad files, or a kind the model has no encoder for, raise UserError and attach nothing.
        """
        actual = media_kind(path)
        if kind is not None and actual != kind:
            raise UserError(f"{path}: {_a(actual)} {actual} file, not {_a(kind)} {kind} file (use /{actual} {path})")
        self._require(actual)
        if actual == "image":
            data: Any = load_image(path, max_pixels=self.max_image_pixels or DEFAULT_MAX_PIXELS)
            data.info["source"] = str(path)  # families name the image by it in their messages
        elif actual == "video":
            data = load_video(
                path,
                fps=self.video_fps or DEFAULT_VIDEO_FPS,
                max_frames=self.video_max_frames or DEFAULT_VIDEO_MAX_FRAMES,
                max_pixels=self.max_image_pixels or DEFAULT_MAX_PIXELS,
            )
        else:
            rate = self.pipe.lm.family.audio_rate(self.pipe.lm)
            data = (load_audio(path, rate)[0], rate)
        item = Attachment(actual, data, str(path))
        self.pending.append(item)
        return item

    # --- turns --------------------------------------------------------------------------------
    def request(self, message: dict, images: list[Any], audios: list[Any], videos: Sequence[Any] = ()) -> Request:
        """The request for the history plus ``message``: all media of the conversation in order."""
        return Request(
            messages=self.messages + [message],
            system_prompt=self.system_prompt,
            images=[x for t in self.turns for x in t.images] + images,
            audios=[x for t in self.turns for x in t.audios] + audios,
            videos=[x for t in self.turns for x in t.videos] + list(videos),
            max_new_tokens=int(self.max_new_tokens),
            ignore_eos=bool(self.ignore_eos),
            stop=[str(s) for s in self.stop],
            thinking=self.thinking,
            adapter=self.adapter,
            **self.constraint,
        )

    def use_adapter(self, name: str | None) -> None:
        """Answer the next turns with this loaded adapter (None: the base model). The
        conversation stays; its keys and values are recomputed under the new adapter at the next
        turn (no KV is shared across adapters)."""
        if name is not None:
            self.pipe.lm.adapters.get(name)  # UserError naming the loaded ones
        self.adapter = name

    def send(
        self,
        text: str,
        images: Sequence[Any] = (),
        audios: Sequence[Any] = (),
        on_text: Callable[[str], None] | None = None,
        videos: Sequence[Any] = (),
    ) -> Result:
        """Answer ``text`` (plus pending attachments and the given media) in the conversation.

        The message shows the pending attachments in the order they were attached, then the
        given images, videos and audio.

        On any failure, KeyboardInterrupt included, the turn is dropped: history and pending
        attachments stay as they were and the cache is cropped back to what it held before.
        """
        if not str(text).strip():
            raise UserError("the message is empty")
        if images:
            self._require("image")
        if audios:
            self._require("audio")
        if videos:
            self._require("video")
        new_images = [a.data for a in self.pending if a.kind == "image"] + list(images)
        new_audios = [a.data for a in self.pending if a.kind == "audio"] + list(audios)
        new_videos = [a.data for a in self.pending if a.kind == "video"] + list(videos)
        labels = [a.label for a in self.pending] + [_label(x) for x in (*images, *videos, *audios)]
        kinds = (
            [a.kind for a in self.pending] + ["image"] * len(images) + ["video"] * len(videos) + ["audio"] * len(audios)
        )
        content = self.pipe.lm.family.content(str(text), len(new_images), len(new_audios), kinds=kinds)
        message = {"role": "user", "content": content}
        request = self.request(message, new_images, new_audios, new_videos)
        before = list(self.cache.keys)
        try:
            result = self.pipe.run(request, cache=self.cache, on_text=on_text)
        except BaseException as err:
            recover(self.cache, self.cache.common_prefix(before))
            if isinstance(err, KeyboardInterrupt):
                self._log(
                    {
                        "event": "interrupted",
                        "turn": len(self.turns) + 1,
                        "user": str(text),
                        "cache_tokens": self.cache.length,
                    }
                )
            raise
        self.pending.clear()
        turn = Turn(
            str(text),
            message,
            new_images,
            new_audios,
            labels,
            result,
            kept=int(result.metrics["kv_reused_tokens"]),
            videos=new_videos,
        )
        self.turns.append(turn)
        self._log(
            {
                "event": "turn",
                "turn": len(self.turns),
                "user": turn.user,
                "media": labels,
                "text": result.text,
                "token_ids": result.token_ids,
                "prompt_tokens": result.prompt_tokens,
                "finish_reason": result.finish_reason,
                "metrics": result.metrics,
            }
        )
        return result

    def undo(self) -> Turn | None:
        """Drop the last exchange and roll the cache back to what that turn started from.

        No recompute: the cache keeps the tokens the undone turn had reused, which are exactly
        the earlier conversation's (as far as the undone prompt shared them).
        """
        if not self.turns:
            return None
        turn = self.turns.pop()
        self.cache.rollback(min(turn.kept, self.cache.length))
        self._log({"event": "undo", "turn": len(self.turns) + 1, "cache_tokens": self.cache.length})
        return turn

    def reset(self) -> None:
        """Forget the conversation, pending attachments and everything cached."""
        self.turns.clear()
        self.pending.clear()
        self.cache.clear()
        self._log({"event": "reset"})

    def _log(self, record: dict) -> None:
        if self.log_path is not None:
            append_jsonl(self.log_path, record)


def recover(cache: KVCache, n: int) -> None:
    """Crop the cache back to its first ``n`` tokens after an interrupted or failed run.

    Ctrl-C can land after a forward pass but before its keys were recorded, or between two
    layers of one pass; ``trim`` first makes every layer hold exactly the recorded keys. If the
    cache cannot be repaired it is cleared (still correct: the next turn recomputes).
    """
    try:
        cache.trim()
        cache.rollback(max(0, min(n, cache.length)))
    except Exception:
        cache.clear()


def _a(word: str) -> str:
    """The indefinite article for ``word`` ("an image", "a video")."""
    return "an" if word[:1] in ("a", "e", "i", "o", "u") else "a"


def _label(item: Any) -> str:
    """How the log names a media item given directly to ``send``: its path, or a content hash."""
    if isinstance(item, (str, os.PathLike)):
        return str(item)
    if isinstance(getattr(item, "source", None), str):  # a Video loaded from a file
        return item.source
    try:
        return "sha256:" + content_hash(item)[:16]
    except TypeError:
        return type(item).__name__
