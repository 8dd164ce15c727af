"""RAG frameworks against a live `kvblend serve` (embedded model), through their real packages.

Each test sends the same documents twice, reordered and with another question, the way the framework
renders them, and checks that every document hit the chunk store the second time. Each test uses its
own document texts, so hits come only from what that test sent.
"""

from __future__ import annotations

import concurrent.futures
import random
import time

import anthropic
import httpx
import openai
import pytest

pytest.importorskip("langchain_openai")
pytest.importorskip("llama_index.llms.openai_like")

from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock  # noqa: E402
from llama_index.core.prompts import chat_prompts, default_prompts  # noqa: E402
from llama_index.core.schema import MetadataMode, TextNode  # noqa: E402
from llama_index.llms.openai_like import OpenAILike  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = "sk-test-frameworks"

# LangChain's RAG tutorial (langchain 1.x, "Build a RAG agent"): the context in the system message.
TUTORIAL_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, say that you don't know. Use "
    "three sentences maximum and keep the answer concise.\n\n{context}"
)
# LangChain's classic rlm/rag-prompt: instruction, question and context in one human message.
CLASSIC = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: "
    "{context} \nAnswer:"
)


@pytest.fixture(scope="module")
def server(kvblend_server_factory):
    config = {
        "api_keys": [{"key": KEY, "name": "fw", "namespace": "fw"}],
        "default_max_tokens": 4,
        "models": [{"id": MODEL, "model": ""}],
    }
    return kvblend_server_factory(config)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def docs(tag: str, n: int = 3) -> list[str]:
    facts = [
        "The lighthouse on {t} island was built in 1874 and painted red by the harbour guild.",
        "The baker of {t} village sells rye bread every Tuesday morning before the market opens.",
        "The {t} river floods each spring when the mountain snow melts above the old mill.",
        "The {t} library keeps a map of the old harbour in its basement next to the archive.",
    ]
    return [facts[i % len(facts)].format(t=f"{tag}{i}") for i in range(n)]


def reordered(ds: list[str]) -> list[str]:
    out = ds[1:] + ds[:1]
    random.Random(1).shuffle(out)
    return out if out != ds else ds[::-1]


def metric(server, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def chunk_hits(server, send) -> tuple[int, int]:
    """(hits, looked up) of the chunk store over one call of ``send``, from /metrics."""
    hit0, miss0 = (
        metric(server, "kvblend_chunks_total", outcome="hit"),
        metric(server, "kvblend_chunks_total", outcome="miss"),
    )
    send()
    hit1, miss1 = (
        metric(server, "kvblend_chunks_total", outcome="hit"),
        metric(server, "kvblend_chunks_total", outcome="miss"),
    )
    return int(hit1 - hit0), int(hit1 - hit0 + miss1 - miss0)


def langchain(server) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server.base_url + "/v1",
        api_key=KEY,
        model=MODEL,
        max_tokens=4,
        temperature=0,
        max_retries=0,
        timeout=120,
    )


def llama(server, chat: bool = True) -> OpenAILike:
    return OpenAILike(
        model=MODEL,
        api_base=server.base_url + "/v1",
        api_key=KEY,
        is_chat_model=chat,
        max_tokens=4,
        temperature=0,
        context_window=8192,
        max_retries=0,
        timeout=120,
    )


def test_langchain_tutorial_system_context(server):
    llm, ds = langchain(server), docs("lctut")

    def ask(order, question):
        context = "\n\n".join(order)
        return llm.invoke(
            [SystemMessage(TUTORIAL_SYSTEM.format(context=context)), HumanMessage(question)]
        )

    assert chunk_hits(server, lambda: ask(ds, "When was the lighthouse built?")) == (0, 3)
    r = None

    def again():
        nonlocal r
        r = ask(reordered(ds), "What does the baker sell?")

    assert chunk_hits(server, again) == (3, 3)
    usage = r.response_metadata["token_usage"]
    assert usage["kvblend"]["chunks_hit"] == 3
    assert (
        r.usage_metadata["input_token_details"]["cache_read"]
        == usage["kvblend"]["reused_tokens"]
        > 0
    )


def test_langchain_classic_prompt(server):
    llm, ds = langchain(server), docs("lcclassic")
    prompt = ChatPromptTemplate.from_messages([("human", CLASSIC)])

    def ask(order, question):
        return (prompt | llm).invoke({"question": question, "context": "\n\n".join(order)})

    assert chunk_hits(server, lambda: ask(ds, "When was the lighthouse built?")) == (0, 3)
    assert chunk_hits(server, lambda: ask(reordered(ds), "Which river floods?")) == (3, 3)


def _nodes(ds: list[str]) -> list[TextNode]:
    return [TextNode(text=d, metadata={"file_path": f"/data/{i}.txt"}) for i, d in enumerate(ds)]


def _context(nodes: list[TextNode]) -> str:  # what LlamaIndex's synthesizers put in {context_str}
    return "\n\n".join(n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes)


def test_llamaindex_text_qa_chat_template(server):
    llm, nodes = llama(server), _nodes(docs("litqa"))

    def ask(order, query):
        return llm.chat(
            chat_prompts.CHAT_TEXT_QA_PROMPT.format_messages(
                context_str=_context(order), query_str=query
            )
        )

    assert chunk_hits(server, lambda: ask(nodes, "When was the lighthouse built?")) == (0, 3)
    r = None

    def again():
        nonlocal r
        r = ask(reordered(nodes), "Which library keeps a map?")

    assert chunk_hits(server, again) == (3, 3)
    assert (
        r.raw.usage.model_extra["kvblend"]["chunks_total"] == 3
    )  # one chunk per node, metadata included


def test_llamaindex_refine_templates(server):
    nodes = _nodes(docs("lirefine"))
    chat_llm, text_llm = llama(server), llama(server, chat=False)

    def chat(order, query):
        return chat_llm.chat(
            chat_prompts.CHAT_REFINE_PROMPT.format_messages(
                context_msg=_context(order), query_str=query, existing_answer="Not known."
            )
        )

    def complete(order, query):  # the text template (------------ rules) through /v1/completions
        return text_llm.complete(
            default_prompts.DEFAULT_REFINE_PROMPT.format(
                context_msg=_context(order), query_str=query, existing_answer="Not known."
            )
        )

    assert chunk_hits(server, lambda: chat(nodes, "When was the lighthouse built?")) == (0, 3)
    assert chunk_hits(server, lambda: chat(reordered(nodes), "What floods?")) == (3, 3)
    # The completions prompt has no chat template around it; a chunk is its text alone: same keys.
    assert chunk_hits(server, lambda: complete(reordered(nodes), "Who sells bread?")) == (3, 3)
    qa = default_prompts.DEFAULT_TEXT_QA_PROMPT.format(
        context_str=_context(nodes[::-1]), query_str="Where is the map?"
    )
    assert chunk_hits(server, lambda: text_llm.complete(qa)) == (3, 3)


def test_llamaindex_multiblock_message(server):
    """LlamaIndex sends a text-only multi-block message as one string, its blocks glued with nothing
    between them; blocks that end with a blank line (docs/FRAMEWORKS.md) come apart again."""
    llm, ds = llama(server), docs("liblocks")

    def ask(order, query):
        blocks = [TextBlock(text=d + "\n\n") for d in order] + [TextBlock(text=query)]
        return llm.chat([ChatMessage(role=MessageRole.USER, blocks=blocks)])

    assert chunk_hits(server, lambda: ask(ds, "When was the lighthouse built?")) == (0, 3)
    assert chunk_hits(server, lambda: ask(reordered(ds), "What is sold?")) == (3, 3)


def test_llamaindex_glued_blocks_of_known_documents(server):
    """Blocks glued with nothing between them: documents the server already cached (here through
    /v1/chunks) are found by their text wherever they sit."""
    llm, ds = llama(server), docs("liglued")

    def ask(order, query):
        blocks = [TextBlock(text=d) for d in order] + [TextBlock(text=query)]
        return llm.chat([ChatMessage(role=MessageRole.USER, blocks=blocks)])

    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.base_url + "/v1/chunks", json={"documents": ds}, headers=auth)
    assert r.status_code == 200
    assert chunk_hits(server, lambda: ask(ds, "When was the lighthouse built?")) == (3, 3)
    assert chunk_hits(server, lambda: ask(reordered(ds), "What is sold?")) == (3, 3)


def test_one_document_one_chunk_every_way(server, client):
    """After /v1/chunks, the same documents hit whichever way they come in."""
    ds = docs("oneway", 2)
    q = "Which fact is about bread?"
    r = httpx.post(
        server.base_url + "/v1/chunks",
        json={"documents": ds},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200 and not any(c["cached"] for c in r.json()["data"])

    def openai_chat(**kw):
        return client.chat.completions.create(model=MODEL, max_tokens=2, **kw).usage.model_extra[
            "kvblend"
        ]

    ant = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)

    def messages(content):
        r = ant.messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": content}]
        )
        return r.usage.model_extra["kvblend"]

    order = ds[::-1]
    ways = {
        "documents": lambda: openai_chat(
            messages=[{"role": "user", "content": q}], extra_body={"documents": order}
        ),
        "parts": lambda: openai_chat(
            messages=[
                {"role": "user", "content": [{"type": "text", "text": t} for t in order + [q]]}
            ]
        ),
        "plain": lambda: openai_chat(
            messages=[{"role": "user", "content": "\n\n".join(order + [q])}]
        ),
        "anthropic_text": lambda: messages([{"type": "text", "text": t} for t in order + [q]]),
        "anthropic_document": lambda: messages(
            [
                {
                    "type": "document",
                    "source": {"type": "text", "media_type": "text/plain", "data": t},
                }
                for t in order
            ]
            + [{"type": "text", "text": q}]
        ),
    }
    for name, send in ways.items():
        kv = send()
        assert (kv["chunks_hit"], kv["chunks_total"]) == (2, 2), (name, kv)


def test_cached_tokens_count_only_kv_used_as_is(server, client):
    ds = docs("honest", 4)
    blend = {"mode": "blend", "recompute_ratio": 0.5}
    client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "Q1?"}],
        extra_body={"documents": ds, **blend},
    )
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "Q2?"}],
        extra_body={"documents": ds[::-1], **blend},
    )
    kv = r.usage.model_extra["kvblend"]
    assert kv["recomputed_tokens"] > 0 and kv["reused_tokens"] > 0
    assert r.usage.prompt_tokens_details.cached_tokens == kv["reused_tokens"] == kv["cached_tokens"]
    ant = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    m = ant.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "Q3?"}],
        extra_body={"documents": reordered(ds), **blend},
    )
    mk = m.usage.model_extra["kvblend"]
    assert mk["recomputed_tokens"] > 0
    assert m.usage.cache_read_input_tokens == mk["reused_tokens"]
    assert m.usage.input_tokens == mk["prompt_tokens"] - mk["reused_tokens"]


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        messages=[{"role": "user", "content": "Name a colour."}],
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= 0
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(tops[0])  # greedy
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        messages=[{"role": "user", "content": "Name a colour."}],
        stream=True,
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    c = client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=3, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == c.usage.completion_tokens
    )
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, max_tokens=2, top_logprobs=2, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body["param"] == "top_logprobs"


def test_unsupported_features_are_400_naming_the_field(server, client):
    msgs = [{"role": "user", "content": "What is the weather?"}]
    tool = {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
    }
    cases = {
        "tools": {"tools": [tool]},
        "tool_choice": {"tool_choice": "required"},
        "response_format": {"response_format": {"type": "json_object"}},
    }
    for field, extra in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **extra)
        assert e.value.body["param"] == field and field in e.value.body["message"]
    client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=2, response_format={"type": "text"}
    )
    llm = langchain(server)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        llm.with_structured_output(
            {"title": "A", "type": "object", "properties": {"a": {"type": "string"}}}
        ).invoke("Say a.")
    with pytest.raises(openai.BadRequestError, match="tools"):
        llm.bind_tools([tool]).invoke("Weather?")


def test_long_prompt_without_documents_is_warned(server, client):
    text = " ".join(f"word{i} is a token sequence with no paragraph breaks." for i in range(150))
    before = metric(server, "kvblend_unsegmented_prompts_total", reason="no_chunks")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}]
    )
    r = raw.parse()
    kv = r.usage.model_extra["kvblend"]
    assert r.usage.prompt_tokens >= 1024 and kv["chunks_total"] == 0
    assert "no document" in kv["warning"] and raw.headers["x-kvblend-warning"] == kv["warning"]
    assert metric(server, "kvblend_unsegmented_prompts_total", reason="no_chunks") == before + 1
    short = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hello there."}]
    )
    assert (
        "x-kvblend-warning" not in short.headers
        and "warning" not in short.parse().usage.model_extra["kvblend"]
    )


def test_metrics_grafana_shape(server, client):
    health = metric(server, "kvblend_requests_total", endpoint="/health")
    for _ in range(3):
        httpx.get(server.base_url + "/health")
    stream = client.chat.completions.create(
        model=MODEL,
        max_tokens=40,
        stream=True,
        temperature=0,
        messages=[{"role": "user", "content": "Write a long poem about the sea."}],
    )
    gen_before = metric(server, "kvblend_completion_tokens_total", model_name=MODEL)
    got = 0
    for chunk in stream:  # cut the stream after two pieces of text
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 2:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while metric(server, "kvblend_completion_tokens_total", model_name=MODEL) == gen_before:
        assert time.monotonic() < deadline, "the cut stream's tokens were never counted"
        time.sleep(0.1)
    text = httpx.get(server.base_url + "/metrics").text
    assert metric(server, "kvblend_requests_total", endpoint="/health") == health == 0
    assert "_created" not in text and 'model="' not in text
    for name in (
        "kvblend_ttft_seconds",
        "kvblend_inter_token_latency_seconds",
        "kvblend_e2e_request_latency_seconds",
        "kvblend_request_queue_time_seconds",
        "kvblend_request_prompt_tokens",
        "kvblend_request_generation_tokens",
    ):
        assert f'{name}_count{{model_name="{MODEL}"}}' in text, name
    assert "process_cpu_seconds_total" in text and "process_resident_memory_bytes" in text
    info = [line for line in text.splitlines() if line.startswith("kvblend_model_info{")]
    assert len(info) == 1 and f'model_name="{MODEL}"' in info[0] and 'attention_kernel="' in info[0]
    assert 'dtype="' in info[0] and 'version="' in info[0]


def test_models_tokenize_detokenize(server, client):
    card = httpx.get(
        server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
    ).json()["data"][0]
    assert card["max_model_len"] == 8192
    msgs = [{"role": "user", "content": "\n\n".join(docs("tok", 2) + ["Which island?"])}]
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = httpx.post(
        server.base_url + "/tokenize", json={"model": MODEL, "messages": msgs}, headers=auth
    ).json()
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert (
        tok["count"] == len(tok["tokens"]) == r.usage.prompt_tokens and tok["max_model_len"] == 8192
    )
    plain = httpx.post(
        server.base_url + "/tokenize", json={"prompt": "Hello world"}, headers=auth
    ).json()
    back = httpx.post(
        server.base_url + "/detokenize", json={"tokens": plain["tokens"]}, headers=auth
    ).json()
    assert back["prompt"] == "Hello world"
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_every_request_of_a_burst_counts_once(server, client):
    """TTFT, e2e and generation-token series get one observation per request, streamed or not."""
    names = ("kvblend_ttft_seconds_count", "kvblend_e2e_request_latency_seconds_count")
    before = [metric(server, n, model_name=MODEL) for n in names]

    def one(i: int) -> None:
        kw = {"stream": True} if i % 2 else {}
        r = client.chat.completions.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": f"Say {i}."}], **kw
        )
        if kw:
            list(r)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(6)))
    deadline = time.monotonic() + 10  # a stream's last series land just after its [DONE]
    while [metric(server, n, model_name=MODEL) for n in names] != [b + 6 for b in before]:
        assert time.monotonic() < deadline, [metric(server, n, model_name=MODEL) for n in names]
        time.sleep(0.1)


def test_dspy_numbered_context(server, client):
    """DSPy's ChatAdapter layout (rendered as dspy 3.4 does; the dspy package is not installed)."""
    from test_layouts import _dspy_list

    ds = docs("dspy")

    def ask(order, question):
        content = (
            f"[[ ## context ## ]]\n{_dspy_list(order)}\n\n[[ ## question ## ]]\n{question}\n\n"
            "Respond with the corresponding output fields, starting with the field "
            "`[[ ## answer ## ]]`."
        )
        system = "Your input fields are:\n1. `context` (list[str])\n2. `question` (str)"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
        r = client.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
        return r.usage.model_extra["kvblend"]

    first = ask(ds, "When was the lighthouse built?")
    assert (first["chunks_hit"], first["chunks_total"]) == (
        0,
        5,
    )  # 3 documents, 2 "»\n[n] «" between
    second = ask(reordered(ds), "Which river floods?")
    assert (second["chunks_hit"], second["chunks_total"]) == (5, 5)
