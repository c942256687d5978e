"""Entry point: ``python -m pipeline [overrides]``. Dispatches on cfg.mode.name."""

from __future__ import annotations

import dataclasses
import difflib
import gc
import os
import re
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.types import Override
from hydra.types import RunMode
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from pipeline.errors import UserError
from pipeline.model.lifetime import end_with_launcher
from pipeline.modes import get_mode
from pipeline.cli.outputs import remove_failed_run_dir, stderr_to_log
from pipeline.cli.settings import check, register

register()  # the schema config.yaml composes over

# Installed, the configs are the package's conf/ (pyproject maps the top-level conf/ there);
# in the source tree they are the top-level conf/ itself.
CONF_DIR = next(
    (d for d in (Path(__file__).parent / "conf", Path(__file__).parents[1] / "conf") if d.is_dir()),
    Path(__file__).parent / "conf",
)


def fail(message: str) -> None:
    """One line on stderr, non-zero exit, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_group_choices(argv: list[str]) -> None:
    """Unknown +model=NAME (or sampler/quant/mode) gets one clear line instead of Hydra's dump."""
    for arg in argv:
        match = re.fullmatch(r"[+~]{0,2}(model|sampler|quant|mode)=([^=]*)", arg)
        if not match:
            continue
        group, values = match.groups()
        for name in values.split(","):  # multirun sweeps: quant=nf4,none
            if name and not (CONF_DIR / group / f"{name}.yaml").is_file():
                options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
                fail(f"unknown {group} {name!r}: choose one of {', '.join(options)}")


# Hydra's own flags: with these the command line is not (only) overrides, so Hydra handles it all.
_HYDRA_FLAGS = (
    "-h",
    "--help",
    "--hydra-help",
    "-c",
    "--cfg",
    "-p",
    "--package",
    "--info",
    "--resolve",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "-sc",
    "--shell-completion",
    "--experimental-rerun",
)


def one_line(err: Exception) -> str:
    """Hydra's composition error as one line: its first sentence and, for a value of the wrong
    type, the reason (OmegaConf's first line), without the key dump."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("See https")]
    cause = str(err.__cause__).splitlines()[0] if err.__cause__ is not None else ""
    if lines and lines[0].startswith("Error merging override "):
        return f"{lines[0].removeprefix('Error merging override ')}: {cause}"
    return " ".join(lines)


def _is_group_or_hydra(override: Override) -> bool:
    """+model=NAME, mode=bench, hydra/launcher=...: a config group; hydra.run.dir=...: Hydra's own."""
    key = override.key_or_group
    return (CONF_DIR / key).is_dir() or key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _schema_view(node: object) -> object:
    """A section its mode leaves unset (``serve`` outside mode=serve) read as its schema's defaults."""
    if isinstance(node, DictConfig) and node._is_none() and dataclasses.is_dataclass(node._metadata.ref_type):
        return OmegaConf.structured(node._metadata.ref_type)
    return node


def _is_schema(node: object) -> bool:
    """A section whose keys the schema fixes (pipeline/cli/settings.py), not one the user fills freely
    (``stages``, ``sampler``, ``model.processor``: their keys are the user's classes' arguments)."""
    return isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))


def unknown_key(cfg: DictConfig, key: str) -> bool:
    """True when ``key`` names no setting: a schema section on its path lacks the next name."""
    node: object = cfg
    for part in key.split("."):
        node = _schema_view(node)
        if not _is_schema(node):
            return False  # a value, a list or a free section: Hydra decides
        if part not in node.keys():
            return True
        node = node._get_node(part)
    return False


def unset_section(cfg: DictConfig, key: str) -> str | None:
    """The section on ``key``'s path its mode leaves unset (``ceval`` outside mode=ceval), if any:
    Hydra cannot set a key there (it fails with an assertion)."""
    node: object = cfg
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node, DictConfig) or part not in node.keys():
            return None
        node = node._get_node(part)
        if isinstance(node, DictConfig) and node._is_none():
            return ".".join(parts[: i + 1])
    return None


def setting_keys(node: object, prefix: str = "") -> list[str]:
    """Every dotted key of the composed settings (the candidates a misspelt key is matched against)."""
    node = _schema_view(node)
    if not isinstance(node, DictConfig) or node._is_none():
        return []
    keys = []
    for name in node.keys():
        key = f"{prefix}{name}"
        keys += [key] + setting_keys(node._get_node(name), f"{key}.")
    return keys


def check_keys(cfg: DictConfig, parsed: list[Override], texts: list[str]) -> None:
    """Refuse a key the settings do not have, ``+`` or not, suggesting the closest one: Hydra would
    add ``+max_new_token=5`` silently (the run then uses the default) and answer ``foo=1`` by
    advising ``+foo=1``. ``+`` stays for what is open: config groups (``+model=NAME``), Hydra's settings and
    the free sections (``+stages.NAME._target_=...``, ``+sampler.ARG=...``, ``+model.processor.ARG=...``)."""
    for override, text in zip(parsed, texts):
        if override.is_delete() or _is_group_or_hydra(override):
            continue
        key = override.key_or_group
        verb = "add" if override.is_add() or override.is_force_add() else "override"
        if unknown_key(cfg, key):
            close = difflib.get_close_matches(key, setting_keys(cfg), n=1)
            hint = (
                f"did you mean {close[0]}={text.split('=', 1)[1]}?"
                if close
                else "python -m pipeline --cfg job lists them"
            )
            fail(f"Could not {verb} {key!r}: no such setting; {hint}")
        section = unset_section(cfg, key)
        if section:
            why = f"read with mode={section} only" if (CONF_DIR / "mode" / f"{section}.yaml").is_file() else "unset"
            fail(f"Could not {verb} {key!r}: the {section} settings are {why}")


def check_overrides(argv: list[str]) -> None:
    """Compose the configuration once up front, so a bad override (a value of the wrong type, an
    unknown key, a syntax error) is one line instead of Hydra's report. Each value of a sweep
    (``quant=nf4,none``) is tried on its own."""
    if any(arg.split("=")[0] in _HYDRA_FLAGS for arg in argv):
        return
    overrides = [arg for arg in argv if not arg.startswith("-")]  # -m / --multirun
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        first = [
            f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else text
            for o, text in zip(parsed, overrides)
        ]
        trials = [first] + [
            first[:i] + [f"{o.get_key_element()}={value}"] + first[i + 1 :]
            for i, o in enumerate(parsed)
            if o.is_sweep_override()
            for value in list(o.sweep_string_iterator())[1:]
        ]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            groups_seen = set()
            for trial in trials:
                groups = tuple(t for o, t in zip(parsed, trial) if _is_group_or_hydra(o) and not o.is_delete())
                if groups not in groups_seen:  # which keys exist depends on the groups (mode=serve)
                    groups_seen.add(groups)
                    check_keys(compose("config", overrides=list(groups)), parsed, overrides)
                compose("config", overrides=trial)
    except HydraException as err:
        fail(one_line(err))


# The cycle collector's thresholds as Python set them: ``main`` holds off its full collections
# while the imports load, ``settle_imports`` puts them back.
GC_THRESHOLDS = gc.get_threshold()


def settle_imports() -> None:
    """Put what the job's imports made (torch, transformers, the library: about 430,000 objects,
    alive until the process ends) out of the cycle collector's reach (``gc.freeze``), and let
    it make full collections again (``main`` held them off while the imports loaded).

    Why: every full collection walks every object again, and the heap's growth triggers one
    after each quarter more: on a 2-core machine seven of them during the imports (1.4 s), and
    with torch loaded 0.5-0.75 s each, two of them inside a cached compile's wait (``warmup_s``)
    and more in a long-running server. Frozen, collections walk only what the job makes since.
    The young collections ran all along, so little garbage is frozen with the rest (resident
    memory within 1 MiB of before; with the collector off while importing, 12 MiB more). Here,
    not in the library: the collector is the process's business (a program that imports the
    library keeps its own as it is)."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def release_job() -> None:
    """Free what the finished job held before the next one of a sweep loads.

    Why: a model, its KV pool and its engine refer to each other (the pool and engine are kept
    on the model object), so only the cycle collector frees them, at a time of its choosing; in
    a multirun (``-m quant=nf4,none``) the next job would size its pool from free memory while
    the last job's pool still held most of it. Collected here, and CUDA's cached blocks handed
    back, the next job starts from what a new process would see. A single job's process ends
    instead: everything is frozen, so that the interpreter's exit does not walk it all once more
    (1.8 s of every run's end on a 2-core machine).
    """
    if not _more_jobs():
        gc.freeze()
        return
    gc.collect()  # (what ``settle_imports`` froze stays frozen: the imports outlive every job)
    torch = sys.modules.get("torch")  # not imported: the job stopped before loading anything
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _more_jobs() -> bool:
    """Whether this process runs a sweep (``-m``): more jobs may follow this one."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_job(cfg: DictConfig) -> None:
    """The checked job: rank 0 (or the only process) runs its mode; ranks 1..N-1 follow rank 0's
    steps on their shard. Imports torch and the library, which --help, --cfg and a bad setting
    never need (they answer in a second instead of ten)."""
    from pipeline.model import tensor_parallel
    from pipeline.cli.assemble import follow_from_cfg

    tensor_parallel.request(int(cfg.model.tp), str(cfg.mode.name))
    mode = follow_from_cfg if tensor_parallel.follower() else get_mode(str(cfg.mode.name))
    settle_imports()
    mode(cfg)


def leave_group() -> None:
    """The end of a job: rank 0 tells the other ranks to stop; every rank leaves the group (none
    was joined where the library was never imported)."""
    tensor_parallel = sys.modules.get("pipeline.model.tensor_parallel")
    if tensor_parallel is not None:
        tensor_parallel.finish()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    try:
        with stderr_to_log():  # __main__.log holds the run's report, as stderr shows it
            try:
                check(cfg)  # the rules types cannot say, once, before the mode reads anything
                run_job(cfg)
            except (UserError, ValueError) as err:  # ValueError: a stage refusing its settings (the Python API's error)
                fail(str(err))
            except KeyboardInterrupt:
                print("\ninterrupted", file=sys.stderr)
                sys.exit(130)
    except SystemExit as stop:
        if stop.code == 2:  # an error: exit before any result: no empty run folder left behind
            remove_failed_run_dir()
        raise
    finally:
        leave_group()
        release_job()


def main() -> None:
    end_with_launcher()  # first: a torchrun rank must not outlive its launcher, even by the seconds below
    gc.set_threshold(*GC_THRESHOLDS[:2], 2**30)  # no full collection while the imports load (``settle_imports``)
    if sys.argv[1:] == ["--list-models"]:
        from pipeline.families.catalogue import table

        print(table())
        return
    check_group_choices(sys.argv[1:])
    check_overrides(sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hydra_main()


if __name__ == "__main__":
    main()
