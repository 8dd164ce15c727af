"""Sub-command registration shared by `kvblend` and its command groups (e.g. `kvblend bench`)."""

from __future__ import annotations

import argparse
import importlib


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, except where there is none to show (None, False)
    or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "%(default)" in text or "default" in text or default in (None, False, argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            text += " (default: %(default)s)"
        return text


def add_command_parsers(
    sub: argparse._SubParsersAction, commands: list[tuple[str, str, str]], run_attr: str
) -> None:
    """For each (name, module, help): a sub-parser filled by ``module.add_arguments`` whose
    defaults carry ``module.run`` under ``run_attr``. A kvblend module missing from this
    checkout is left out."""
    for name, module, help_text in commands:
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter
        )
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("kvblend"):
                continue
            raise
        mod.add_arguments(p)
        p.set_defaults(**{run_attr: mod.run})


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model and --dtype, as every command that loads an engine takes them
    (defaults: KVBLEND_*)."""
    from kvblend.config import default_dtype, default_model

    p.add_argument(
        "--model",
        default=default_model(),
        help="HF dir or .gguf (default: KVBLEND_MODEL, else the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default=default_dtype(),
        choices=["auto", "bfloat16", "float32"],
        help="auto (default): bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, else float32",
    )
