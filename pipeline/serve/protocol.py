"""The OpenAI request shapes this server accepts, checked by pydantic, and what they become:
our ``Request`` (messages with media placeholders, images, videos and audio in prompt order, sampler).

Unknown fields are ignored (clients send many); known fields of the wrong type are refused.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImageURL(_Open):
    url: str
    detail: str | None = None


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Open):
    url: str


class VideoPart(_Open):
    """vLLM's extension for video: ``{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}``."""

    type: Literal["video_url"]
    video_url: VideoURL


class AudioData(_Open):
    data: str  # base64, no data: prefix (OpenAI's input_audio)
    format: str | None = None


class AudioPart(_Open):
    type: Literal["input_audio"]
    input_audio: AudioData


Part = Annotated[Union[TextPart, ImagePart, VideoPart, AudioPart], Field(discriminator="type")]


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[Part], None] = None


class StreamOptions(_Open):
    include_usage: bool = False


class Sampling(_Open):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class ChatCompletionRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: Union[str, list[str]]


FINISH = {"eos": "stop", "stop": "stop", "length": "length", None: "stop"}
