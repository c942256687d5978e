"""What a first run of the shipped scripts sends the embedded default: questions it answers.

benchmarks/serve_load.py's default workload is the embedded default's own task (drawn shapes
images as OpenAI image content, its two questions), so every request gets content; the answers
are checked here through the server's own image decoding and the pipeline, without a server.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import Pipeline, Request, load_model
from pipeline.serve.media import MediaPolicy, image_from_url
from pipeline.tiny import default_model_dir
from pipeline.tiny.shapes import QUESTIONS
from stages import DecodeLoop, Prefill, Tokenize, VisionEncoder

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def serve_load():
    return load_script("benchmarks/serve_load.py")


def test_serve_load_defaults_to_image_requests_the_embedded_default_answers(serve_load):
    args = serve_load.parse_args(["--requests", "6"])
    assert args.prompts == "shapes" and args.image == 0
    all_msgs, expected = serve_load.workload(args)
    assert len(all_msgs) == len(expected) == 6 and all(expected)
    assert all_msgs == serve_load.workload(args)[0]  # seeded: the same requests every phase and run
    pipe = Pipeline(
        load_model(str(default_model_dir())),
        {"tokenize": Tokenize(), "vision_encoder": VisionEncoder(), "prefill": Prefill(), "decode": DecodeLoop()},
    )
    answers = []
    for msgs in all_msgs:
        [message] = msgs
        image_part, text_part = message["content"]  # OpenAI image content, then the question
        assert image_part["type"] == "image_url" and image_part["image_url"]["url"].startswith("data:image/png;base64,")
        assert text_part["type"] == "text" and text_part["text"] in QUESTIONS
        image = image_from_url(image_part["image_url"]["url"], "messages[0].content[0]", MediaPolicy())
        answers.append(pipe.run(Request(prompt=text_part["text"], images=[image], max_new_tokens=args.max_tokens)).text)
    assert all(a.strip() for a in answers), answers  # every request gets content
    assert sum(a.strip() == e for a, e in zip(answers, expected)) >= 5, list(zip(answers, expected))


def test_serve_load_keeps_text_prompts_behind_a_flag(serve_load):
    args = serve_load.parse_args(["--prompts", "text", "--requests", "3", "--image", "8"])
    all_msgs, expected = serve_load.workload(args)
    assert expected == [None] * 3
    assert [m[0]["content"][0]["type"] for m in all_msgs] == ["image_url"] * 3
    assert all(isinstance(m[0]["content"][1]["text"], str) for m in all_msgs)
    plain, _ = serve_load.workload(serve_load.parse_args(["--prompts", "text", "--requests", "2"]))
    assert all(isinstance(m[0]["content"], str) for m in plain)
    with pytest.raises(SystemExit):  # a generated picture only goes with text prompts
        serve_load.parse_args(["--image", "64"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
def test_a_server_the_load_script_started_ends_when_the_script_is_killed(tmp_path):
    """``serve_load.Server`` (also ``compile_beside.py``'s) starts the server in a session of its
    own, out of reach of Ctrl-C and group kills: it must still end when the script dies, SIGKILL
    included, not live on holding its port and cores."""
    script = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); from pathlib import Path; "
        "from serve_load import Server; "
        f"server = Server([], 60.0, Path({str(tmp_path)!r})); print(server.proc.pid, flush=True); time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert process_alive(child)
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 60
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_alive(child)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, already ended, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
