"""mode=serve: load the model once, serve the OpenAI-compatible API until SIGINT/SIGTERM.

Settings are checked and the port is bound before the model loads, so a typo or a busy port
costs one line, not a model load. On a signal the server stops accepting connections, lets
requests in flight finish for ``serve.drain_s`` seconds, cancels the rest and exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path

import uvicorn
from omegaconf import DictConfig

from pipeline.cli.assemble import (
    load_from_cfg,
    max_image_pixels,
    pipeline_from_cfg,
    request_from_cfg,
    stages_from_cfg,
    video_sampling,
)
from pipeline.context import POOLINGS
from pipeline.errors import UserError, whole_number
from pipeline.model.loading import weights_line
from pipeline.serve.app import create_app
from pipeline.serve.protocol import ServeSettings
from pipeline.serve.calls import log
from pipeline.serve.media import MediaPolicy


def settings_from_cfg(cfg: DictConfig) -> ServeSettings:
    s = cfg.serve
    media_dir = s.allowed_media_dir
    if media_dir is not None and not Path(str(media_dir)).is_dir():
        raise UserError(f"serve.allowed_media_dir {media_dir}: not a folder")
    max_audio_s = s.max_audio_s
    if isinstance(max_audio_s, bool) or not isinstance(max_audio_s, (int, float)) or max_audio_s <= 0:
        raise UserError(f"serve.max_audio_s must be a number > 0 (got {max_audio_s!r})")
    video_fps, video_max_frames = video_sampling(cfg)
    if s.pooling not in POOLINGS:
        raise UserError(f"serve.pooling must be one of {', '.join(POOLINGS)} (got {s.pooling!r})")
    key = s.api_key if s.api_key is not None else os.environ.get("MM_PIPELINE_API_KEY") or None
    if key is not None and not str(key).strip():
        raise UserError("serve.api_key is empty: give a key or leave it null")
    return ServeSettings(
        model_name=str(s.model_name or cfg.model.path or "tiny-default"),
        api_key=None if key is None else str(key),
        max_body_bytes=whole_number("serve.max_body_bytes", s.max_body_bytes),
        max_tokens=whole_number("serve.max_tokens", s.max_tokens),
        default_max_tokens=min(whole_number("max_new_tokens", cfg.max_new_tokens), s.max_tokens),
        max_n=whole_number("serve.max_n", s.max_n),
        pooling=str(s.pooling),
        max_waiting=None if s.max_waiting is None else whole_number("serve.max_waiting", s.max_waiting, minimum=0),
        cors_origins=[str(o) for o in s.cors_origins],
        max_stored_responses=whole_number("serve.max_stored_responses", s.get("max_stored_responses", 1000), minimum=0),
        runtime_lora=bool(s.get("runtime_lora", True)),
        media=MediaPolicy(
            allowed_dir=None if media_dir is None else Path(str(media_dir)),
            allow_remote=bool(s.allow_remote_media),
            allowed_domains=frozenset(str(h).lower() for h in s.allowed_media_domains),
            max_images=whole_number("serve.max_images", s.max_images, minimum=0),
            max_audios=whole_number("serve.max_audios", s.max_audios, minimum=0),
            max_videos=whole_number("serve.max_videos", s.get("max_videos", 2), minimum=0),
            max_image_pixels=max_image_pixels(cfg),
            max_audio_s=float(max_audio_s),
            video_fps=video_fps,
            video_max_frames=video_max_frames,
        ),
    )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a busy port or a bad host is one line before the model loads."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named explicitly: asyncio sets TCP_NODELAY on accepted connections only
        # then; without it Nagle's algorithm held each stream's first chunk back ~40 ms.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as err:
        raise UserError(
            f"cannot listen on {host}:{port} ({err.strerror if isinstance(err, OSError) else err})"
        ) from None
    return sock


def main(cfg: DictConfig) -> None:
    settings = settings_from_cfg(cfg)
    port = whole_number("serve.port", cfg.serve.port, minimum=0)
    request_from_cfg(cfg, prompt="check")  # the shared request settings (stop, max_new_tokens...) are valid
    stages = stages_from_cfg(cfg)
    sock = bind(str(cfg.serve.host), port)
    lm = load_from_cfg(cfg)
    log(weights_line(lm))
    pipe = pipeline_from_cfg(cfg, lm, stages)  # decode.compile: warmed up here, before the first request
    host, port = sock.getsockname()[:2]

    # An idle keep-alive connection stays open 65 s: a client (or a load balancer, whose idle timeout
    # is usually 60 s) reusing one the server is closing at that instant gets a connection error;
    # at uvicorn's default of 5 s, a client pausing about 5 s between requests hit that race.
    config = uvicorn.Config(
        None, log_level="warning", timeout_graceful_shutdown=cfg.serve.drain_s, timeout_keep_alive=65
    )
    server = uvicorn.Server(config)

    def ready() -> None:
        auth = "API key required" if settings.api_key else "no API key"
        log(f"serving {settings.model_name} on http://{host}:{port} ({auth}; chat page at /, metrics at /metrics)")

    config.app = create_app(pipe, settings, draining=lambda: server.should_exit, on_ready=ready)
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="mm-http", daemon=True)

    def stop(signum: int, _frame: object) -> None:
        if server.should_exit:  # a second signal: stop waiting for the drain
            server.force_exit = True
        else:
            log(f"{signal.Signals(signum).name}: no new requests; draining for up to {cfg.serve.drain_s} s")
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    http.start()
    # The engine runs here, on the thread that loaded the model; the event loop has its own.
    # (CPU kernels keep one OpenMP thread team per calling thread: a second thread doing the
    # model work made decoding 2-30x slower on a 2-core machine.)
    pipe.engine.drive(lambda: not http.is_alive())
    log("stopped")
