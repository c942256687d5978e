"""mode=chat: an interactive conversation on one KV cache (a thin REPL over ``ChatSession``).

One message per line, from a terminal or a pipe. Answers stream to stdout, one per line;
prompts, notices and /stats go to stderr, so ``python -m pipeline mode=chat < q.txt > a.txt``
captures only the answers. Every finished turn is appended to ``chat.jsonl`` in the run folder.
"""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from omegaconf import DictConfig, OmegaConf

from pipeline.cli.assemble import (
    input_paths,
    load_from_cfg,
    max_image_pixels,
    finish_compile,
    pipeline_from_cfg,
    request_from_cfg,
    video_sampling,
)
from pipeline.frontends.chat_session import ChatSession
from pipeline.errors import UserError
from pipeline.model.loading import weights_line
from pipeline.metrics import format_table
from pipeline.cli.outputs import run_dir
from pipeline.structured.response_format import CLI_FIELDS

COMMANDS = "/help /reset /undo /image PATH /video PATH /audio PATH /adapter [NAME] /stats /exit"
HELP = """\
Type a message and press Enter. Commands:
  /image PATH   attach an image to your next message
  /video PATH   attach a video clip to your next message (mp4, webm, mov, animated gif)
  /audio PATH   attach an audio file to your next message
  /undo         drop the last exchange (the cache rolls back, nothing is recomputed)
  /reset        clear the conversation and the cache
  /adapter NAME answer with this LoRA adapter (model.lora) from now on; /adapter none: the base
                model; /adapter alone: which one answers, and those loaded
  /stats        metrics of the last turn
  /help         this help
  /exit         quit (Ctrl-D too)
Ctrl-C stops an answer and drops it from the conversation. Start a message with // to send
a line that begins with /."""


class Repl:
    """Reads lines, runs commands or sends messages; never exits on a bad command or file."""

    def __init__(
        self,
        session: ChatSession,
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        stream: bool = True,
    ) -> None:
        self.session = session
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.stream = stream
        self.commands: dict[str, Callable[[str], bool]] = {
            "/help": self.cmd_help,
            "/reset": self.cmd_reset,
            "/undo": self.cmd_undo,
            "/image": lambda arg: self.cmd_attach("image", arg),
            "/video": lambda arg: self.cmd_attach("video", arg),
            "/audio": lambda arg: self.cmd_attach("audio", arg),
            "/adapter": self.cmd_adapter,
            "/stats": self.cmd_stats,
            "/exit": lambda arg: False,
        }

    def note(self, text: str) -> None:
        print(text, file=self.stderr, flush=True)

    def read(self) -> str | None:
        """The next line without its newline, or None at end of input (Ctrl-D / EOF)."""
        if self.stdin is sys.stdin and self.stdin.isatty():
            if self.stdout.isatty():  # readline echoes to stdout: only when that is the terminal
                try:
                    import readline  # noqa: F401  (line editing and history for input())
                except ImportError:
                    pass
            self.stderr.write("> ")
            self.stderr.flush()
            try:
                return input()  # line editing; prompt already on stderr so stdout stays answers only
            except EOFError:
                self.stderr.write("\n")
                return None
        line = self.stdin.readline()
        return None if line == "" else line.rstrip("\r\n")

    def loop(self) -> None:
        """Until /exit or end of input. Ctrl-C at the prompt only says how to quit."""
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:
                self.note("\n(Ctrl-C: type /exit or press Ctrl-D to quit)")
                continue
            if line is None or not self.handle(line):
                return

    def handle(self, line: str) -> bool:
        """One input line; False means quit."""
        if not line.strip():
            return True
        if line.startswith("//"):
            return self.send(line[1:])
        if not line.startswith("/"):
            return self.send(line)
        name, *rest = line.strip().split(maxsplit=1)
        arg = rest[0] if rest else ""
        command = self.commands.get(name.lower())
        if command is None:
            self.note(f"unknown command {name}: commands are {COMMANDS}")
            return True
        return command(arg.strip())

    def send(self, text: str) -> bool:
        def write(piece: str) -> None:
            self.stdout.write(piece)
            self.stdout.flush()

        try:
            result = self.session.send(text, on_text=write if self.stream else None)
        except KeyboardInterrupt:
            write("\n")
            self.note(
                f"[stopped: answer dropped from the conversation, cache rolled back to "
                f"{self.session.cache.length} tokens]"
            )
            return True
        except UserError as err:
            self.note(f"error: {err}")
            return True
        if not self.stream:
            write(result.text)
        write("\n")
        return True

    # --- commands ------------------------------------------------------------------------------
    def cmd_help(self, arg: str) -> bool:
        self.note(HELP)
        return True

    def cmd_reset(self, arg: str) -> bool:
        self.session.reset()
        self.note("[conversation and cache cleared]")
        return True

    def cmd_undo(self, arg: str) -> bool:
        turn = self.session.undo()
        if turn is None:
            self.note("nothing to undo")
        else:
            self.note(
                f"[undone: {turn.user!r}; {len(self.session.turns)} turns left, cache rolled back to "
                f"{self.session.cache.length} tokens]"
            )
        return True

    def cmd_attach(self, kind: str, arg: str) -> bool:
        path = arg.strip().strip("'\"")
        if not path:
            self.note(f"usage: /{kind} PATH")
            return True
        try:
            item = self.session.attach(path, kind)  # type: ignore[arg-type]
        except UserError as err:
            self.note(f"error: {err}")
            return True
        detail = f" ({item.data.num_frames} frames over {item.data.duration:.1f} s)" if item.kind == "video" else ""
        self.note(f"[{kind} {path}{detail} attached to your next message]")
        return True

    def cmd_adapter(self, arg: str) -> bool:
        name = arg.strip()
        session = self.session
        if not name:
            loaded = ", ".join(a.name for a in session.pipe.lm.adapters.loaded()) or "none (model.lora)"
            self.note(f"answering with: {session.adapter or 'the base model'}; adapters loaded: {loaded}")
            return True
        try:
            session.use_adapter(None if name == "none" else name)
        except UserError as err:
            self.note(f"error: {err}")
            return True
        self.note(f"[answering with {session.adapter or 'the base model'} from the next message]")
        return True

    def cmd_stats(self, arg: str) -> bool:
        last = self.session.last
        if last is None:
            self.note("no turn yet")
        else:
            self.note(f"turn {len(self.session.turns)}  finish={last.finish_reason}")
            self.note(format_table(last.metrics))
        return True


def main(cfg: DictConfig) -> None:
    # The run's settings fail here, before the model loads; input= media are attached below,
    # once the model is known (attach checks the model has an encoder for them).
    settings = request_from_cfg(OmegaConf.merge(cfg, {"input": None}), prompt=None)
    pixel_guard = max_image_pixels(cfg)
    video_fps, video_max_frames = video_sampling(cfg)
    lm = load_from_cfg(cfg)
    print(weights_line(lm), file=sys.stderr)
    session = ChatSession(
        # One conversation: the batch-of-one warm-up. A first compile in a process of its own
        # (``compile_apart``), on the CPU the user leaves idle while reading and typing.
        pipeline_from_cfg(cfg, lm, rows=1, said=False, apart=True),
        system_prompt=settings.system_prompt,
        max_new_tokens=settings.max_new_tokens,
        ignore_eos=settings.ignore_eos,
        stop=settings.stop,
        thinking=settings.thinking,
        log_path=run_dir() / "chat.jsonl",
        max_image_pixels=pixel_guard,
        video_fps=video_fps,
        video_max_frames=video_max_frames,
        constraint={name: getattr(settings, name) for name in CLI_FIELDS if getattr(settings, name) is not None},
        adapter=settings.adapter,
    )
    for path in input_paths(cfg):  # input=PATH: media for the first message
        session.attach(path)
    repl = Repl(session, stream=bool(cfg.stream))
    repl.note(f"chat with {lm.path} ({lm.family.name}); /help for commands, Ctrl-D or /exit to quit")
    if cfg.prompt is not None:
        repl.send(str(cfg.prompt))
    repl.loop()
    finish_compile(session.pipe, rows=1)  # decode.compile=auto: a build still running, for the next chat
