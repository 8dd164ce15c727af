"""How a request prefills, as one value: ``PrefillPolicy``, parsed once from its one spelling.

    full | prefix | reuse | blend | blend@0.15 | blend@0.15/lookahead
         | blend@0.1/lookahead:8 | default

The engine resolves a request's partial policy against its BlendConfig into a complete one; benches,
the client, the server and the scripts all parse and print policies here, so a new selection is one
enum member and one strategy (kvblend/blend/strategies.py), not edits across eight modules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Mode(StrEnum):
    FULL = "full"
    PREFIX = "prefix"
    REUSE = "reuse"
    BLEND = "blend"


class Selection(StrEnum):
    """Which chunk tokens `blend` recomputes: each kind but auto is a strategy registered in
    kvblend/blend/strategies.py."""

    DEVIATION = "deviation"  # the paper's: fresh vs cached KV at a check layer
    QUERY = "query"  # the query's attention at the check layer (experimental: lookahead dominates)
    LOOKAHEAD = "lookahead"  # the query's attention over a reuse pass run first
    AUTO = "auto"  # the model family's measured best (kvblend/engine/fidelity.py FAMILY_DEFAULTS)


PREFILL_MODES = tuple(m.value for m in Mode)
SELECTION_KINDS = tuple(s.value for s in Selection if s is not Selection.AUTO)
SELECTION_PRESETS = (Selection.AUTO.value,)
DEFAULT = "default"  # a policy that names nothing: the server's or engine's own default
DEFAULT_RATIO = 0.15  # the paper's; a selection other than auto with no ratio named runs it


def validate_mode(mode: str) -> Mode:
    if mode not in PREFILL_MODES:
        raise ValueError(
            f"unknown prefill mode {mode!r}; expected one of {', '.join(PREFILL_MODES)}"
        )
    return Mode(mode)


def validate_ratio(ratio: float) -> float:
    if not (0.0 <= float(ratio) <= 1.0):
        raise ValueError(f"recompute_ratio must be within [0, 1], got {ratio}")
    return float(ratio)


def validate_selection(selection: str) -> Selection:
    if selection not in SELECTION_KINDS + SELECTION_PRESETS:
        raise ValueError(
            f"unknown token selection {selection!r}; expected one of "
            f"{', '.join(SELECTION_KINDS + SELECTION_PRESETS)}"
        )
    return Selection(selection)


def validate_lookahead_layers(num_layers: int) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(
            f"lookahead_layers must be an integer >= 0 (0 = every layer), got {num_layers!r}"
        )
    return num_layers


def parse_selection(text: str) -> tuple[Selection, int | None]:
    """ "deviation", "query", "lookahead", "auto" or "lookahead:N" (the reuse pass runs the first N
    layers) -> (kind, N or None)."""
    kind, sep, depth = text.partition(":")
    kind = validate_selection(kind)
    if not sep:
        return kind, None
    if kind != Selection.LOOKAHEAD:
        raise ValueError(f"only lookahead takes a layer count ('lookahead:8'), got {text!r}")
    if not depth.isdigit():
        raise ValueError(
            f"lookahead's layer count must be a whole number ('lookahead:8'), got {text!r}"
        )
    return kind, validate_lookahead_layers(int(depth))


@dataclass(frozen=True)
class PrefillPolicy:
    """Mode, recompute ratio, token selection and lookahead depth. A field left None takes the
    engine's default; ``resolve`` fills them. ``mode`` None is the policy named "default"."""

    mode: Mode | None = None
    ratio: float | None = None
    selection: Selection | None = None
    lookahead_layers: int | None = None  # lookahead only; 0 = every layer

    @classmethod
    def parse(cls, text: str) -> PrefillPolicy:
        """``mode[@ratio][/selection[:depth]]``, or "default"; a ratio or selection needs blend."""
        spec, _, selection = text.strip().partition("/")
        mode, _, ratio = spec.partition("@")
        if mode == DEFAULT and not ratio and not selection:
            return cls()
        mode = validate_mode(mode)
        if (ratio or selection) and mode != Mode.BLEND:
            raise ValueError(
                f"only blend takes a ratio or a token selection ('blend@0.15/lookahead'), "
                f"got {text!r}"
            )
        kind, depth = parse_selection(selection) if selection else (None, None)
        return cls(mode, validate_ratio(float(ratio)) if ratio else None, kind, depth)

    @classmethod
    def from_fields(
        cls,
        mode: str | None = None,
        ratio: float | None = None,
        selection: str | None = None,
        lookahead_layers: int | None = None,
    ) -> PrefillPolicy:
        """A request's separate fields (``selection`` may carry a depth: "lookahead:8")."""
        kind, depth = parse_selection(selection) if selection else (None, None)
        if lookahead_layers is not None:
            depth = validate_lookahead_layers(lookahead_layers)
        return cls(
            None if mode is None else validate_mode(mode),
            None if ratio is None else validate_ratio(ratio),
            kind,
            depth,
        )

    @property
    def is_default(self) -> bool:
        return self.mode is None

    @property
    def selection_label(self) -> str | None:
        """The selection as requests and benches spell it: "lookahead:8" for a shortened reuse
        pass."""
        if self.selection is None:
            return None
        depth = self.lookahead_layers if self.selection == Selection.LOOKAHEAD else None
        return f"{self.selection}:{depth}" if depth else str(self.selection)

    @property
    def label(self) -> str:
        """The policy's one spelling: what ``parse`` reads back."""
        if self.mode is None:
            return DEFAULT
        label = f"{self.mode}@{self.ratio:g}" if self.ratio is not None else str(self.mode)
        return f"{label}/{self.selection_label}" if self.selection else label

    @property
    def chain_tag(self) -> str:
        """Part of chained (blended-prefix) keys: blended KV depends on the mode, ratio and
        selection, so entries of one never serve another. Needs a resolved policy."""
        if self.mode != Mode.BLEND or self.selection == Selection.DEVIATION:
            return f"{self.mode}@{self.ratio:g}"
        return f"{self.mode}@{self.ratio:g}/{self.selection_label}"

    def request_fields(self) -> dict:
        """The kvblend request fields that ask a server for this policy (none for "default")."""
        if self.mode is None:
            return {}
        out: dict = {"mode": str(self.mode)}
        if self.ratio is not None:
            out["recompute_ratio"] = self.ratio
        if self.selection is not None:
            out["selection"] = self.selection_label
        return out

    def with_defaults(
        self, mode: str, ratio: float | None, selection: str, lookahead_layers: int
    ) -> PrefillPolicy:
        """Every field None here taken from the given defaults."""
        return replace(
            self,
            mode=self.mode or Mode(mode),
            ratio=ratio if self.ratio is None else self.ratio,
            selection=self.selection or Selection(selection),
            lookahead_layers=lookahead_layers
            if self.lookahead_layers is None
            else self.lookahead_layers,
        )
