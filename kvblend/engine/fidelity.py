"""A fidelity target instead of a ratio: pick the blend setting that keeps first-token agreement
with full prefill at or above a target, from a calibration run and from shadow full prefills of
live requests.

`kvblend calibrate` measures, per model and dtype, first-token agreement / KL / paired TTFT
speed-up of each (selection, ratio) against full prefill and writes them next to the model's
weights cache (``calibration_path``). For a target, ``FidelityController.choose`` takes the
fastest measured setting whose agreement meets it at a one-sided 90% Wilson lower bound
(``agreement_lower_bound``; a setting needs enough prompts to resolve the target,
``prompts_needed``); where none does (or nothing is calibrated), full prefill: the target is then
met by construction, and the request's stats say so (``source``). Shadow full prefills of sampled
live requests (run when the engine is idle) add their outcome to the setting's count, so a setting
whose live agreement drifts under the target stops being chosen.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvblend.config import validate_fidelity  # noqa: F401  (re-exported for callers here)
from kvblend.policy import DEFAULT_RATIO

CALIBRATION_VERSION = 1

# selection "auto": (selection, ratio) per model family (HF model_type), where a request names no
# ratio: each family's measured best at the paper's speed (docs/FIDELITY.md has the runs).
FAMILY_DEFAULTS: dict[str, tuple[str, float]] = {
    "llama": ("lookahead", 0.1),
    "qwen2": ("lookahead", 0.3),
}
AUTO_FALLBACK = ("deviation", DEFAULT_RATIO)  # families never measured: the paper's setting


def family_default(model_type: str | None) -> tuple[str, float]:
    """(selection, ratio) that selection auto runs on ``model_type``'s family."""
    return FAMILY_DEFAULTS.get(model_type or "", AUTO_FALLBACK)


def calibration_path(cache_dir: Path, model_dir: Path, dtype: str) -> Path:
    """``<cache_dir>/calibration/<weights dir name>-<dtype>.json``: beside the converted weights
    cache (``<cache_dir>/models/<name>``), keyed by dtype too (bf16 and fp32 blends differ)."""
    return Path(cache_dir) / "calibration" / f"{Path(model_dir).name}-{dtype}.json"


@dataclass
class CalibrationPoint:
    """One blend setting measured against full prefill on ``n`` prompts."""

    selection: str  # as requests spell it ("lookahead", "lookahead:8", "deviation")
    ratio: float
    n: int
    agreement: float  # first-token agreement with full prefill, 0..1
    kl: float  # mean first-token KL(full || blend), nats
    speedup: float | None = None  # median paired TTFT(full) / TTFT(blend)

    @property
    def key(self) -> str:
        return f"{self.selection}@{self.ratio:g}"


@dataclass
class Calibration:
    model_id: str
    fingerprint: str
    dtype: str
    data: str
    points: list[CalibrationPoint]
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))
    version: int = CALIBRATION_VERSION

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)  # atomic: a server reading it never sees half a file

    @classmethod
    def load(cls, path: Path) -> "Calibration | None":
        """The calibration at ``path``, or None if absent or unreadable (nothing calibrated)."""
        try:
            raw = json.loads(Path(path).read_text())
            if raw.get("version") != CALIBRATION_VERSION:
                return None
            points = [CalibrationPoint(**p) for p in raw.pop("points")]
            return cls(points=points, **{k: v for k, v in raw.items() if k != "points"})
        except (OSError, ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class Setting:
    """What a request with a fidelity target runs with, and why (reported in ``usage.kvblend``)."""

    mode: str  # "blend" or "full"
    ratio: float
    selection: str | None
    target: float
    expected_agreement: (
        float | None
    )  # calibration + shadow estimate; None where nothing was measured
    source: str  # "calibration", "calibration+shadow", or "fallback: ..."


# One-sided 90% confidence: a setting serves a target only if the lower bound of its measured
# agreement reaches it. Choosing the fastest setting whose point estimate passes picks the luckiest
# sample (scripts/fidelity_holdout.py measured held-out agreement under the target that way).
CONFIDENCE_Z = 1.2816


def agreement_lower_bound(agreement: float, n: int, z: float = CONFIDENCE_Z) -> float:
    """Wilson score lower bound of a first-token agreement measured on ``n`` prompts."""
    if n <= 0:
        return 0.0
    z2n = z * z / n
    center = agreement + z2n / 2
    spread = z * math.sqrt(agreement * (1 - agreement) / n + z2n / (4 * n))
    return max(0.0, (center - spread) / (1 + z2n))


def prompts_needed(target: float, z: float = CONFIDENCE_Z) -> int:
    """Fewest prompts on which a setting agreeing on every one reaches ``target`` at the lower bound
    (n / (n + z^2) >= target): 15 for 0.9, 32 for 0.95. A blend never serves a target of 1.0."""
    if target >= 1.0:
        return 1 << 30
    return math.ceil(z * z * target / (1.0 - target) - 1e-9)


@dataclass
class _Tally:
    agree: int = 0
    total: int = 0


class FidelityController:
    """Chooses settings for fidelity targets and keeps the live agreement per setting.
    Thread-safe: the engine's worker records shadow outcomes while the server reads ``agreement``
    for /metrics."""

    def __init__(self, calibration: Calibration | None):
        self.calibration = calibration
        self._live: dict[str, _Tally] = {}
        self._lock = threading.Lock()

    def estimate(self, point: CalibrationPoint) -> tuple[float, int]:
        """(agreement, prompts) of ``point``: calibration counts pooled with shadow outcomes."""
        with self._lock:
            live = self._live.get(point.key, _Tally())
        agree = point.agreement * point.n + live.agree
        total = point.n + live.total
        return (agree / total if total else 0.0), total

    def choose(self, target: float) -> Setting:
        if self.calibration is None or not self.calibration.points:
            return Setting(
                "full",
                1.0,
                None,
                target,
                None,
                "fallback: no calibration for this model (run `kvblend calibrate`); full prefill",
            )
        best, best_speed, best_agree = None, -math.inf, None
        needed = prompts_needed(target)
        for point in self.calibration.points:
            agreement, n = self.estimate(point)
            speed = point.speedup if point.speedup is not None else 1.0 / max(point.ratio, 1e-3)
            passes = agreement_lower_bound(agreement, n) >= target
            if passes and point.ratio < 1.0 and speed > best_speed:
                best, best_speed, best_agree = point, speed, agreement
        if best is None and max(self.estimate(p)[1] for p in self.calibration.points) < needed:
            return Setting(
                "full",
                1.0,
                None,
                target,
                1.0,
                f"fallback: a target of {target:g} needs >= {needed} measured prompts per setting "
                f"(calibration has {self.calibration.points[0].n}); full prefill",
            )
        if best is None:
            top = max(self.calibration.points, key=lambda p: self.estimate(p)[0])
            return Setting(
                "full",
                1.0,
                None,
                target,
                1.0,
                f"fallback: no blend setting reached {target:g} at the 90% lower bound (best "
                f"{top.key}: {self.estimate(top)[0]:.2f} on {self.estimate(top)[1]} prompts); "
                "full prefill",
            )
        with self._lock:
            shadowed = self._live.get(best.key, _Tally()).total > 0
        return Setting(
            "blend",
            best.ratio,
            best.selection,
            target,
            round(best_agree, 4),
            "calibration+shadow" if shadowed else "calibration",
        )

    def record(self, selection: str, ratio: float, agreed: bool) -> None:
        """A shadow full prefill's verdict on a request blended with (selection, ratio)."""
        key = f"{selection}@{ratio:g}"
        with self._lock:
            tally = self._live.setdefault(key, _Tally())
            tally.agree += int(agreed)
            tally.total += 1

    def live_agreement(self) -> tuple[float, int] | None:
        """Shadow-measured agreement over every setting (None before the first shadow prefill)."""
        with self._lock:
            total = sum(t.total for t in self._live.values())
            agree = sum(t.agree for t in self._live.values())
        return (agree / total, total) if total else None

    def calibrated_agreement(self, target: float | None) -> float | None:
        """Expected agreement of the setting ``target`` chooses (None without a target)."""
        if target is None:
            return None
        return self.choose(target).expected_agreement
