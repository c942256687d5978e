"""Entry point: ``python -m pipeline [overrides]``. Dispatches on cfg.mode.name."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pipeline.errors import UserError

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


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_main(cfg: DictConfig) -> None:
    from pipeline.modes import get_mode

    try:
        get_mode(str(cfg.mode.name))(cfg)
    except (UserError, ValueError) as err:  # ValueError: a stage refusing its settings (the Python API's error)
        fail(str(err))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


def main() -> None:
    check_group_choices(sys.argv[1:])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hydra_main()


if __name__ == "__main__":
    main()
