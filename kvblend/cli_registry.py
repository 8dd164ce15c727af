"""Sub-command registration shared by `kvblend` and its command groups (e.g. `kvblend bench`)."""

from __future__ import annotations

import argparse
import importlib


def add_command_parsers(sub: argparse._SubParsersAction, commands: list[tuple[str, str, str]], run_attr: str) -> None:
    """For each (name, module, help): a sub-parser filled by ``module.add_arguments`` whose defaults carry
    ``module.run`` under ``run_attr``. A kvblend module missing from this checkout is left out."""
    for name, module, help_text in commands:
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("kvblend"):
                continue
            raise
        mod.add_arguments(p)
        p.set_defaults(**{run_attr: mod.run})
