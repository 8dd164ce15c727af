"""The tests' one helpers module: real embedded weights, MuSiQue prompts, tiny random-weight models;
random chunk KV and child interpreters for the store tests; a fake engine and app clients for the
server tests."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from kvblend.bench.data import DEFAULT_MUSIQUE
from kvblend.blend.segmenter import Segments
from kvblend.config import ApiKey, BlendConfig, EngineConfig, ModelConfig, ModelEntry, ServerConfig
from kvblend.engine.engine import Engine, create_engine
from kvblend.engine.request import GenerationResult, PrefillStats, TokenEvent
from kvblend.server.app import create_app
from kvblend.server.backends import LocalBackend
from kvblend.store.base import ChunkKV
from kvblend.store.serializer import serialize

MUSIQUE = DEFAULT_MUSIQUE
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
INSTRUCTION = "Answer the question from the passages. Answer within 5 words.\n\n"


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package), so tests
    call its functions."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Gates parametrized over this run on the CPU everywhere and on CUDA where a GPU is present (CI has
# none; `pytest tests -k cuda` on a GPU machine runs just those).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@lru_cache(maxsize=None)
def embedded_engine(
    dtype: str = "float32", attention_kernel: str = "auto", device: str = "cpu"
) -> Engine:
    """The embedded model; ``attention_kernel`` "auto" takes the native kernel where this CPU has
    it, "torch" pins PyTorch's kernels (so both prefill attention paths stay gated)."""
    return create_engine(
        EngineConfig(
            model=ModelConfig(
                dtype=dtype, device=device, num_threads=2, attention_kernel=attention_kernel
            )
        )
    )


def musique_docs(example: int = 0, num_docs: int = 4) -> tuple[list[str], str]:
    item = json.loads(MUSIQUE.read_text())[example]
    docs = [f"{c['title']}: {' '.join(c['text'].split())}" for c in item["ctxs"][:num_docs]]
    return docs, f"Question: {item['question']}\nAnswer within 5 words."


def tiny_model_dir(tmp: Path, model_type: str = "llama", rope_scaling: dict | None = None) -> Path:
    """A random-weight model of ``model_type`` with the embedded model's tokenizer (so chat
    templates and segments work); small enough to build in a second."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = embedded_engine("float32").loaded.model_dir
    kwargs = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    if rope_scaling is not None:
        kwargs["rope_parameters"] = rope_scaling
    cfg = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    out = tmp / f"tiny-{model_type}"
    model.save_pretrained(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def tiny_engine(model_dir: Path, **blend) -> Engine:
    return create_engine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype="float32"), blend=BlendConfig(**blend)
        )
    )


# ---- store tests: random chunk KV, bit-exact comparison, a child interpreter ---------------------
REPO = Path(__file__).resolve().parents[1]


def make_kv(
    seed: int = 0,
    layers: int = 4,
    heads: int = 2,
    seq_len: int = 16,
    dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
) -> ChunkKV:
    """Random ChunkKV, k/v [layers, heads, seq_len, dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (layers, heads, seq_len, dim)
    return ChunkKV(
        torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so equality is bit-for-bit (NaN-safe, -0 != +0)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: ChunkKV | None, b: ChunkKV) -> bool:
    return (
        a is not None
        and a.k.dtype == b.k.dtype
        and torch.equal(bits(a.k), bits(b.k))
        and torch.equal(bits(a.v), bits(b.v))
    )


def kv_size(store_key: str, kv: ChunkKV) -> int:
    return len(serialize(store_key, kv))


def run_python(code: str, env: dict | None = None, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter of this venv (repo on sys.path); return
    stdout, raise on failure.

    For multi-process tests (e.g. two engine processes sharing one disk dir / Redis): build the
    store or engine inside ``code`` from a StoreConfig and print what the parent should check.
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


# ---- server tests: a word-per-token fake engine and TestClients over it --------------------------
CLIENT_KEY = "sk-client-key"


class FakeTokenizer:
    """A word is a token whose id is the word's length."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(w) for w in text.split()]

    def __len__(self) -> int:
        return 64  # the vocabulary: ids are word lengths

    def decode(self, ids: list[int] | int, **_) -> str:  # an int too, as HF tokenizers take
        ids = [ids] if isinstance(ids, int) else ids
        return " ".join("w" * max(int(i), 1) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        """``<role> content`` per message, then ``<assistant>``: the server segments with it."""
        text = "".join(f"<{m['role']}> {m['content']} " for m in messages)
        return text + ("<assistant> " if add_generation_prompt else "")


class FakeSeq:
    def __init__(self, req, stats):
        self.request, self.stats = req, stats
        self.generated: list[int] = []
        self.text = ""
        self.finished = False
        self.pending: list[TokenEvent] = []

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.generated), self.text, "length", self.stats)


class FakeEngine:
    """Words are tokens; generates "t0 t1 ..." up to max_tokens. ``gate`` holds
    start() until set."""

    model_id = "fake-model"
    max_context_len = 64
    tokenizer = FakeTokenizer()

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.gate, self.fail = gate, fail
        self.in_start = threading.Event()
        self.batch_sizes: list[int] = []
        self.step_delay = 0.0

    def segments(self, documents, question, **_) -> Segments:
        return Segments([1], [self.tokenizer.encode(d) for d in documents], [])

    def precompute(self, chunks, namespace=""):
        return [{"key": f"k{len(c)}", "num_tokens": len(c), "cached": False} for c in chunks]

    def start(self, req) -> FakeSeq:
        self.in_start.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("secret internal detail")
        n = req.segments.num_tokens
        seq = FakeSeq(
            req,
            PrefillStats(
                mode=req.policy.mode or "blend",
                recompute_ratio=0.15,
                prompt_tokens=n,
                fresh_tokens=n,
                ttft_ms=1.0,
            ),
        )
        seq.pending.append(self._token(seq))
        return seq

    def _token(self, seq: FakeSeq) -> TokenEvent:
        i = len(seq.generated)
        seq.generated.append(i)
        text = f"t{i} "
        seq.text += text
        if len(seq.generated) >= seq.request.sampling.max_tokens:
            seq.finished = True
        top_k = seq.request.sampling.logprobs
        if top_k is None:
            return TokenEvent(i, text, i)
        # as the real engine reports them: the token's logprob and the top k, most likely first
        return TokenEvent(i, text, i, -0.5, [(j, -0.5 - j) for j in range(top_k)])

    def step(self, seqs):
        self.batch_sizes.append(len(seqs))
        time.sleep(self.step_delay)
        return [
            s.pending.pop(0) if s.pending else (None if s.finished else self._token(s))
            for s in seqs
        ]


def make_keyed_client(engine=None, models: list[ModelEntry] | None = None, **config) -> TestClient:
    cfg = ServerConfig(
        models=models or [ModelEntry(id="fake")], api_keys=[ApiKey(CLIENT_KEY, "c")], **config
    )
    backends = [LocalBackend(m, None, cfg, engine=engine or FakeEngine()) for m in cfg.models]
    return TestClient(create_app(cfg, backends=backends), raise_server_exceptions=False)


def run_bench_engine(*args: str) -> subprocess.CompletedProcess:
    """`kvblend bench engine` in a child process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvblend.cli", "bench", "engine", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
