"""What a new user meets first: a self-contained clone, the CLI's first run, the store commands, the
environment's key names, generated docs and readable plots."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import kvblend
from kvblend.bench.data import DEFAULT_MUSIQUE, load_musique

REPO = Path(__file__).resolve().parents[1]


def _kvblend(
    *args: str, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvblend.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def test_evaluation_data_ships_in_the_package_with_its_licence():
    package = Path(kvblend.__file__).resolve().parent
    assert DEFAULT_MUSIQUE.is_relative_to(package) and DEFAULT_MUSIQUE.is_file()
    examples = load_musique()
    assert len(examples) == 100 and all(len(ex.passages) == 10 and ex.answers for ex in examples)
    notice = (DEFAULT_MUSIQUE.parent / "README.md").read_text()
    assert "CC BY 4.0" in notice and "Trivedi" in notice


def test_nothing_reads_a_folder_beside_the_clone():
    pattern = re.compile(r"\.\./shared|parents\[2\]\s*/\s*\"shared\"|parent\s*/\s*\"shared\"")
    files = [
        *REPO.glob("kvblend/**/*.py"),
        *REPO.glob("tests/*.py"),
        *REPO.glob("scripts/**/*.py"),
        *REPO.glob("scripts/**/*.sh"),
        REPO / "Makefile",
        REPO / ".ci" / "run",
    ]
    offenders = [
        f.relative_to(REPO)
        for f in files
        if f != Path(__file__) and pattern.search(f.read_text(errors="replace"))
    ]
    assert offenders == []


def test_version_and_help_with_defaults():
    version = _kvblend("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kvblend {kvblend.__version__}"
    help_text = _kvblend("bench", "engine", "--help").stdout
    assert "--ratios" in help_text and "(default: " in help_text
    store_help = " ".join(_kvblend("store", "--help").stdout.split())
    assert "(default: 50)" in store_help  # --limit


def test_store_ls_and_stats_on_an_empty_store(tmp_path):
    env = {"KVBLEND_STORE_TIERS": "memory,disk", "KVBLEND_STORE_DIR": str(tmp_path / "kv")}
    listed = _kvblend("store", "ls", env=env)
    assert listed.returncode == 0 and listed.stdout.strip() == "(no entries)", listed.stderr
    stats = _kvblend("store", "stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    tiers = json.loads(stats.stdout)
    assert list(tiers) == ["memory", "disk"]  # the tiers the server would use, in its order
    assert "budget" in tiers["memory"]["note"] and tiers["disk"]["entries"] == 0
    only_memory = json.loads(
        _kvblend("store", "stats", "--json", env={"KVBLEND_STORE_TIERS": "memory"}).stdout
    )
    assert list(only_memory) == ["memory"]


def test_store_stats_follows_the_server_config_file(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text(
        f"store: {{tiers: [memory, disk], disk_dir: {tmp_path / 'disk-kv'}, "
        f"memory_bytes: 3221225472}}\n"
    )
    tiers = json.loads(_kvblend("store", "stats", "--json", "--config", str(config)).stdout)
    assert list(tiers) == ["memory", "disk"] and "3.0 GiB" in tiers["memory"]["note"]


def test_memory_tier_default_budget_scales_with_the_machine():
    from kvblend.config import StoreConfig

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert StoreConfig().memory_bytes == max(2 << 30, total // 3)


def test_serve_reports_a_busy_port_before_loading_weights():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _kvblend("serve", "--port", str(port))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"kvblend serve: error: port {port} on 127.0.0.1 is already in use (another server?); "
        "choose another with --port"
    )
    assert "Loading weights" not in r.stderr


def test_client_key_variable_does_not_switch_server_auth_on(kvblend_server_factory):
    server = kvblend_server_factory(env={"KVBLEND_API_KEY": "sk-meant-for-the-client"})
    r = httpx.get(server.base_url + "/v1/models", timeout=30)
    assert r.status_code == 200  # auth stays off: the variable is the client's
    logs = server.logs()
    assert "no longer turns server auth on" in logs
    summary = logs[logs.index("kvblend " + kvblend.__version__ + " serving at") :]
    assert f"serving at {server.base_url}/v1" in summary
    assert re.search(
        r"model smollm2-135m-instruct: \w+ on cpu, attention \w+, prefill blend@0.1/lookahead,",
        summary,
    )  # selection auto resolved for the Llama family
    assert "auth: off" in summary and "store: memory " in summary


def test_server_key_variables(monkeypatch, capsys):
    from kvblend import env
    from kvblend.config import client_env_overrides
    from kvblend.settings import load_server_config

    monkeypatch.setattr(env, "_warned", set())  # each warning prints once a process

    for var in (
        "KVBLEND_API_KEY",
        "KVBLEND_API_KEYS",
        "KVBLEND_SERVER_API_KEYS",
        "KVBLEND_CLIENT_API_KEY",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVBLEND_API_KEY", "sk-client")
    assert load_server_config().api_keys == []
    assert client_env_overrides()["api_key"] == "sk-client"
    assert "deprecated" in capsys.readouterr().err
    monkeypatch.setenv("KVBLEND_CLIENT_API_KEY", "sk-client-new")
    assert client_env_overrides()["api_key"] == "sk-client-new"
    monkeypatch.setenv("KVBLEND_SERVER_API_KEYS", "sk-a:team-a,sk-b")
    monkeypatch.setenv("KVBLEND_API_KEYS", "sk-old")
    keys = load_server_config().api_keys
    assert [(k.key, k.namespace) for k in keys] == [
        ("sk-a", "team-a"),
        ("sk-b", ""),
        ("sk-old", ""),
    ]


def test_model_settings_from_the_environment(monkeypatch):
    from kvblend.config import ModelConfig, ModelEntry

    monkeypatch.setenv("KVBLEND_DTYPE", "float32")
    monkeypatch.setenv("KVBLEND_THREADS", "3")
    monkeypatch.setenv("KVBLEND_MODEL", "/models/x.gguf")
    cfg = ModelConfig()
    assert (cfg.dtype, cfg.num_threads, cfg.model) == ("float32", 3, "/models/x.gguf")
    entry = ModelEntry()
    assert (entry.dtype, entry.num_threads, entry.model) == ("float32", 3, "/models/x.gguf")
    monkeypatch.setenv("KVBLEND_THREADS", "two")
    with pytest.raises(ValueError, match="KVBLEND_THREADS"):
        ModelConfig()


def test_benchmark_docs_are_generated_from_the_results():
    r = _kvblend("bench", "report", "--check", cwd=REPO)
    assert r.returncode == 0, (
        r.stderr
    )  # docs/benchmarks.md and the README headline match bench/results


def test_report_renders_every_kind_of_result(tmp_path):
    from kvblend.bench.report import headline, load_results, render_document

    results = load_results(REPO / "bench" / "results")
    doc = render_document(results)
    for title in ("## Engine", "## Server TTFT", "## Answer quality"):
        assert title in doc
    assert "not rendered" not in doc
    assert "| smollm2-135m-instruct |" in headline(results)


def test_headline_shows_each_family_s_default_policy():
    from pathlib import Path

    from kvblend.bench.report import default_policy_label, headline

    assert default_policy_label("llama") == "blend@0.1/lookahead"
    assert default_policy_label("qwen2") == "blend@0.3/lookahead"
    assert default_policy_label(None) == default_policy_label("gemma") == "blend@0.15"

    def run(model, model_type, names):
        modes = [
            {
                "name": name,
                "ttft_median_ms": 1000.0 / (i + 1),
                "speedup_paired_median": float(i + 1),
                "first_token_agreement": 1.0 - i / 10,
                "first_token_kl_vs_full": i / 100,
                "rouge_l_vs_full": 1.0,
            }
            for i, name in enumerate(names)
        ]
        data = {"bench": "engine", "model": model, "examples": 20, "dtype": "bfloat16"}
        return Path(f"{model}.json"), {**data, "model_type": model_type, "modes": modes}

    table = headline(
        [
            run("llama-m", "llama", ["full", "blend@0.15", "blend@0.1/lookahead"]),
            run("old-m", None, ["full", "blend@0.15", "blend@0.1/lookahead"]),
        ]
    )
    llama_row, old_row = [line for line in table.splitlines() if line.endswith(".json` |")]
    assert "`blend@0.1/lookahead` | 333 | 3.00x | 80% | 0.020 |" in llama_row
    assert "`blend@0.15` | 500 | 2.00x | 90% | 0.010 |" in old_row


def test_plots_name_model_machine_and_n(tmp_path):
    from kvblend.bench import plots

    report = json.loads((REPO / "bench/results/eval-20261202-150050.json").read_text())
    report["machine"] = "Test CPU, 2 CPUs"
    caption = plots._caption(report, "n = 10 examples")
    assert caption == "smollm2-135m-instruct | Test CPU, 2 CPUs | n = 10 examples"
    plots.plot_quality_vs_ttft(report, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 10_000
    assert plots._all_near_zero(report, "f1")  # this run's F1: the right panel is what informs


def test_pareto_front_merges_the_runs_of_one_setup_and_is_drawn(tmp_path):
    from kvblend.bench import plots
    from kvblend.bench.report import load_results, pareto_runs

    runs = pareto_runs(load_results(REPO / "bench" / "results"))
    by_model = {(r["model"], plots._data_name(r)): r for r in runs}
    qwen = by_model[("qwen2.5-coder-1.5b-instruct-q4_k_m", "hotpotqa")]
    assert qwen["examples"] >= 20 and {"full", "blend@0.3/lookahead"} <= {
        r["name"] for r in qwen["modes"]
    }
    smol = next(r for (model, _), r in by_model.items() if model == "smollm2-135m-instruct")
    names = [r["name"] for r in smol["modes"]]
    assert len(smol["files"]) > 1 and len(names) == len(set(names))  # newest row of each name
    plots.plot_pareto(runs, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 10_000


def test_fidelity_holdout_scores_the_chosen_setting_on_unseen_prompts():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fidelity_holdout", REPO / "scripts" / "fidelity_holdout.py"
    )
    holdout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(holdout)

    def row(name, mode, ratio, agree, ttft):
        pe = {"first_token_agree": agree, "ttft_ms": ttft, "first_token_kl_vs_full": [0.1] * 40}
        return {"name": name, "mode": mode, "ratio": ratio, "selection": "lookahead"} | {
            "per_example": pe
        }

    result = {
        "model": "m",
        "dtype": "bfloat16",
        "data": "musique",
        "modes": [
            row("full", "full", 1.0, [1.0] * 40, [100.0] * 40),
            row("blend@0.3/lookahead", "blend", 0.3, [1.0] * 40, [25.0] * 40),  # 4x, all agree
            row("blend@0.1/lookahead", "blend", 0.1, [1.0, 1.0, 0.0, 0.0] * 10, [10.0] * 40),
        ],
    }
    # blend@0.1 (10x) agrees on half the prompts of each fold: its 90% lower bound on 20
    # prompts (0.36) serves 0.3, not 0.9
    low, high = holdout.holdout(result, [0.3, 0.9], num_folds=2)
    assert (low["heldout_agreement"], low["heldout_speedup_median"]) == (0.5, 10.0)
    assert (high["heldout_agreement"], high["heldout_speedup_median"]) == (1.0, 4.0)
    assert all(f["ratio"] == 0.3 for f in high["folds"])
