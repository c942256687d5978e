"""Entry point: ``python -m pipeline [overrides]``. Dispatches on cfg.mode.name."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig

from pipeline.errors import UserError
from pipeline.modes import get_mode
from pipeline.settings import check, register

register()  # the schema config.yaml composes over

# Installed, the configs are the package's conf/ (pyproject maps the top-level conf/ there);
# in the source tree they are the top-level conf/ itself.
CONF_DIR = next((d for d in (Path(__file__).parent / "conf", Path(__file__).parents[1] / "conf") if d.is_dir()),
                Path(__file__).parent / "conf")


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
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-p", "--package", "--info", "--resolve",
                "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-sc", "--shell-completion",
                "--experimental-rerun")


def one_line(err: Exception) -> str:
    """Hydra's composition error as one line: its first sentence and, for a value of the wrong
    type, the reason (OmegaConf's first line), without the key dump."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("See https")]
    cause = str(err.__cause__).splitlines()[0] if err.__cause__ is not None else ""
    if lines and lines[0].startswith("Error merging override "):
        return f"{lines[0].removeprefix('Error merging override ')}: {cause}"
    return " ".join(lines)


def check_overrides(argv: list[str]) -> None:
    """Compose the configuration once up front, so a bad override (a value of the wrong type, an
    unknown key, a syntax error) is one line instead of Hydra's report. Each value of a sweep
    (``quant=nf4,none``) is tried on its own."""
    if any(arg.split("=")[0] in _HYDRA_FLAGS for arg in argv):
        return
    overrides = [arg for arg in argv if not arg.startswith("-")]  # -m / --multirun
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else text
                 for o, text in zip(parsed, overrides)]
        trials = [first] + [first[:i] + [f"{o.get_key_element()}={value}"] + first[i + 1:]
                            for i, o in enumerate(parsed) if o.is_sweep_override()
                            for value in list(o.sweep_string_iterator())[1:]]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            for trial in trials:
                compose("config", overrides=trial)
    except HydraException as err:
        fail(one_line(err))


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    try:
        check(cfg)  # the rules types cannot say, once, before the mode reads anything
        get_mode(str(cfg.mode.name))(cfg)
    except (UserError, ValueError) as err:  # ValueError: a stage refusing its settings (the Python API's error)
        fail(str(err))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


def main() -> None:
    check_group_choices(sys.argv[1:])
    check_overrides(sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hydra_main()


if __name__ == "__main__":
    main()
