"""Fidelity targets (kvblend/engine/fidelity.py): the choice rule, the engine honouring it with the
embedded model, shadow full prefills, `kvblend calibrate`, and the server's usage / metrics."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import openai
import pytest
from helpers import INSTRUCTION, embedded_engine, musique_docs

from kvblend.bench import calibrate
from kvblend.engine.fidelity import (
    FAMILY_DEFAULTS,
    Calibration,
    CalibrationPoint,
    FidelityController,
    agreement_lower_bound,
    prompts_needed,
)
from kvblend.engine.request import GenerationRequest, SamplingParams


def _calibration(fingerprint: str = "fp", dtype: str = "float32") -> Calibration:
    # 200 prompts each: 90% lower bounds 0.818 / 0.873 / 0.930
    return Calibration(
        "m",
        fingerprint,
        dtype,
        "musique",
        [
            CalibrationPoint("deviation", 0.15, 200, 0.85, 0.15, 4.3),
            CalibrationPoint("lookahead", 0.15, 200, 0.90, 0.04, 3.5),
            CalibrationPoint("lookahead", 0.5, 200, 0.95, 0.01, 1.8),
        ],
    )


def test_lower_bound_and_prompts_needed():
    assert agreement_lower_bound(1.0, 20) == pytest.approx(20 / (20 + 1.2816**2), abs=1e-4)
    assert agreement_lower_bound(0.95, 20) == pytest.approx(0.847, abs=1e-3)  # 19 of 20
    assert agreement_lower_bound(0.9, 10**6) == pytest.approx(0.9, abs=1e-3)
    assert agreement_lower_bound(0.5, 0) == 0.0
    assert (prompts_needed(0.9), prompts_needed(0.95), prompts_needed(1.0) > 10**6) == (
        15,
        32,
        True,
    )
    # the bound, not the point estimate: 19/20 agreeing does not serve 0.9
    few = Calibration(
        "m", "fp", "float32", "musique", [CalibrationPoint("lookahead", 0.3, 20, 0.95, 0.1, 3.0)]
    )
    assert FidelityController(few).choose(0.9).mode == "full"
    few.points[0].agreement = 1.0  # 20/20: bound 0.924
    assert FidelityController(few).choose(0.9).mode == "blend"


def test_choose_fastest_setting_meeting_target_else_full():
    ctl = FidelityController(_calibration())
    assert (ctl.choose(0.8).selection, ctl.choose(0.8).ratio) == (
        "deviation",
        0.15,
    )  # fastest whose lower bound meets it
    assert (ctl.choose(0.85).selection, ctl.choose(0.85).ratio) == ("lookahead", 0.15)
    assert ctl.choose(0.85).source == "calibration"
    assert ctl.choose(0.85).expected_agreement == 0.9  # the point estimate is what is reported
    assert (ctl.choose(0.9).selection, ctl.choose(0.9).ratio) == ("lookahead", 0.5)
    unreachable = ctl.choose(0.95)
    assert unreachable.mode == "full" and unreachable.ratio == 1.0
    assert unreachable.source.startswith("fallback: no blend setting reached 0.95")
    unresolved = ctl.choose(0.995)  # 200 prompts cannot resolve 0.995
    assert unresolved.mode == "full" and "needs >= 327 measured prompts" in unresolved.source
    nothing = FidelityController(None).choose(0.5)
    assert nothing.mode == "full" and "no calibration" in nothing.source


def test_shadow_outcomes_move_the_choice():
    ctl = FidelityController(_calibration())
    for _ in range(30):  # live traffic disagrees: 180/230 pooled, under 0.85
        ctl.record("lookahead", 0.15, agreed=False)
    chosen = ctl.choose(0.85)
    assert (chosen.selection, chosen.ratio, chosen.source) == ("lookahead", 0.5, "calibration")
    assert ctl.live_agreement() == (0.0, 30)


def test_calibration_roundtrip_and_corrupt_file(tmp_path):
    path = tmp_path / "c.json"
    _calibration().save(path)
    assert Calibration.load(path) == _calibration().__class__(
        **{**_calibration().__dict__, "measured_at": Calibration.load(path).measured_at}
    )
    path.write_text("{not json")
    assert Calibration.load(path) is None
    assert Calibration.load(tmp_path / "missing.json") is None


@pytest.fixture
def engine_with_calibration(tmp_path):
    engine = embedded_engine("float32")
    saved = engine.calibration_path, engine.config.blend.fidelity_shadow_every
    engine.calibration_path = tmp_path / "cal.json"
    _calibration(engine.fingerprint, engine.config.model.dtype).save(engine.calibration_path)
    engine.reload_calibration()
    try:
        yield engine
    finally:
        engine.calibration_path, engine.config.blend.fidelity_shadow_every = saved
        engine.reload_calibration()
        engine._shadow.clear()


def test_engine_runs_the_chosen_setting_and_falls_back_to_full(engine_with_calibration):
    engine = engine_with_calibration
    docs, question = musique_docs(0, 3)
    segs = engine.segments(docs, question, instruction=INSTRUCTION)
    engine.precompute(segs.chunk_ids)
    one = SamplingParams(max_tokens=1)
    res = engine.run(GenerationRequest(segs, one, fidelity=0.85))
    assert (res.stats.mode, res.stats.recompute_ratio, res.stats.selection) == (
        "blend",
        0.15,
        "lookahead",
    )
    assert res.stats.as_dict()["fidelity"] == {
        "target": 0.85,
        "expected_agreement": 0.9,
        "source": "calibration",
    }
    full = engine.run(GenerationRequest(segs, one, mode="full"))
    strict = engine.run(GenerationRequest(segs, one, fidelity=0.99))
    assert strict.stats.mode == "full" and strict.stats.fidelity["source"].startswith("fallback")
    assert (strict.first_token_logits - full.first_token_logits).abs().max().item() == 0.0
    with pytest.raises(ValueError, match="either fidelity or recompute_ratio"):
        engine.run(GenerationRequest(segs, one, fidelity=0.9, recompute_ratio=0.3))
    with pytest.raises(ValueError, match="fidelity must be within"):
        engine.run(GenerationRequest(segs, one, fidelity=1.5))


def test_shadow_full_prefill_records_agreement(engine_with_calibration):
    engine = engine_with_calibration
    engine.config.blend.fidelity_shadow_every = 1
    docs, question = musique_docs(1, 3)
    segs = engine.segments(docs, question, instruction=INSTRUCTION)
    engine.precompute(segs.chunk_ids)
    blended = engine.run(GenerationRequest(segs, SamplingParams(max_tokens=1), fidelity=0.9))
    full = engine.run(GenerationRequest(segs, SamplingParams(max_tokens=1), mode="full"))
    assert engine.has_shadow and engine.run_shadow() and not engine.has_shadow
    agreed = int(blended.first_token_logits.argmax()) == int(full.first_token_logits.argmax())
    assert engine.fidelity.live_agreement() == (float(agreed), 1)


def test_calibrate_cli_writes_a_calibration_the_engine_reads(tmp_path, capsys):
    out = tmp_path / "cal.json"
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    args = parser.parse_args(
        [
            "--dtype",
            "float32",
            "--threads",
            "2",
            "--examples",
            "1",
            "--ratios",
            "0.5,1.0",
            "--selections",
            "deviation",
            "--targets",
            "0.5",
            "--out",
            str(out),
        ]
    )
    assert calibrate.run(args) == 0
    cal = Calibration.load(out)
    assert [(p.selection, p.ratio, p.n) for p in cal.points] == [
        ("deviation", 0.5, 1),
        ("deviation", 1.0, 1),
    ]
    assert cal.points[1].agreement == 1.0 and cal.points[1].kl < 1e-3  # ratio 1 is full prefill
    assert cal.fingerprint == embedded_engine("float32").fingerprint
    assert "fidelity 0.5 ->" in capsys.readouterr().out


def test_server_reports_fidelity_in_usage_and_metrics(kvblend_server_factory, tmp_path):
    engine = embedded_engine("float32")
    path = tmp_path / "cal.json"
    _calibration(engine.fingerprint, "float32").save(path)
    server = kvblend_server_factory(
        {
            "models": [
                {
                    "id": "smol",
                    "model": "",
                    "dtype": "float32",
                    "fidelity": 0.9,
                    "calibration": str(path),
                }
            ]
        }
    )
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120
    )
    docs, question = musique_docs(2, 2)
    resp = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        extra_body={"documents": docs},
    )
    usage = resp.usage.model_extra["kvblend"]
    assert (usage["mode"], usage["selection"], usage["fidelity"]["target"]) == (
        "blend",
        "lookahead",
        0.9,
    )
    strict = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": question}],
        max_tokens=1,
        extra_body={"documents": docs, "fidelity": 0.99},
    )
    assert strict.usage.model_extra["kvblend"]["mode"] == "full"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": question}],
            max_tokens=1,
            extra_body={"fidelity": 0},
        )
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'kvblend_fidelity_agreement{model_name="smol",source="calibration"} 0.9' in metrics
    assert json.loads(Path(path).read_text())["fingerprint"] == engine.fingerprint


def test_auto_selection_takes_the_family_default(engine_with_calibration):
    engine = engine_with_calibration
    docs, question = musique_docs(0, 2)
    segs = engine.segments(docs, question, instruction=INSTRUCTION)
    engine.precompute(segs.chunk_ids)
    one = SamplingParams(max_tokens=1)
    assert engine.loaded.model_type == "llama"
    auto = engine.run(GenerationRequest(segs, one, mode="blend", selection="auto")).stats
    assert (auto.selection, auto.recompute_ratio) == FAMILY_DEFAULTS["llama"]
    own_ratio = engine.run(
        GenerationRequest(segs, one, mode="blend", selection="auto", recompute_ratio=0.3)
    ).stats
    assert (own_ratio.selection, own_ratio.recompute_ratio) == ("lookahead", 0.3)
