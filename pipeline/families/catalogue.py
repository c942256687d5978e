"""Which model types run, through which family, with which inputs: ``python -m pipeline --list-models``.

Generated from the code (the family registry, the generic vision family's rules, transformers'
own image-text-to-text mapping), so the answer to "does it run my model?" cannot drift from what
the loader does. docs/models.md is this command's output.
"""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.families import registry, vision


def rows() -> list[tuple[str, str, str, str]]:
    """(model_type, family, inputs, status) for every type a family names and every type
    transformers maps to an image-text-to-text class; sorted by model_type."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    out = {}
    for model_type, cls in registry().items():
        out[model_type] = (model_type, cls.name, _inputs(cls.media), "runs (a family of its own)")
    for model_type in sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) | set(vision.REFUSED)):
        if model_type in out:
            continue
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # a type whose config transformers cannot build without its remote code
            config = SimpleNamespace(model_type=model_type)
        try:
            reason = vision.refusal(config)
        except Exception as err:  # a config the rules cannot read: say so rather than guess
            reason = f"cannot tell ({type(err).__name__})"
        if reason is not None:
            status = f"refused: {reason}"
        else:
            status = "runs (tested)" if model_type in vision.TESTED else "untested: the generic family takes it"
        media = vision.VisionFamily(config).media if reason is None else vision.VisionFamily.media
        out[model_type] = (model_type, vision.VisionFamily.name, _inputs(media), status)
    return [out[k] for k in sorted(out)]


def _inputs(media: tuple[str, ...]) -> str:
    return ", ".join(("text", *media))


def table() -> str:
    """``rows()`` as a Markdown table, with the text family's rule under it."""
    lines = ["| model_type | family | inputs | status |", "|---|---|---|---|"]
    lines += [f"| `{t}` | {f} | {i} | {s} |" for t, f, i, s in rows()]
    lines += [
        "",
        "Any other decoder-only text model (`AutoModelForCausalLM`) whose layers are full or "
        "sliding-window attention runs through the text family; other layers are refused before loading.",
    ]
    return "\n".join(lines)
