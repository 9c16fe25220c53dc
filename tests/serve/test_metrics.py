"""/metrics: Prometheus text under vLLM's names, one registry per app; the engine's state read at scrape time, and
request counts, tokens and latencies from where requests finish, on every generating route."""
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh_transformer.serve.completion import Event, GenerationRequest
from mesh_transformer.serve.metrics import ServingMetrics
from mesh_transformer.tokenizer import load_tokenizer
from tests.helpers import tiny_server

KEY = "metrics-key"


def samples(exposition: bytes | str) -> dict:
    """{(sample name, labels without model_name): value} of a Prometheus exposition."""
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[sample.name, labels] = sample.value
    return out


def value(scraped: dict, name: str, **labels) -> float:
    return scraped[name, tuple(sorted(labels.items()))]


class FakeEngine:
    """An engine's stats() and nothing else."""

    def __init__(self, prefix_cache: bool = True):
        self.state = {"slots": {"total": 8, "busy": 3, "free": 5}, "queue": {"waiting": 2, "max": 64},
                      "requests": {"completed": 0, "cancelled": 0, "preempted": 0}}
        if prefix_cache:
            self.state["prefix_cache"] = {"enabled": True, "queried_tokens": 100, "hit_tokens": 40}

    def stats(self) -> dict:
        return self.state


def test_engine_state_is_read_at_scrape_time_and_prefix_cache_counters_move_with_its_hits():
    engine = FakeEngine()
    metrics = ServingMetrics(engine.stats, "m")
    scraped = samples(metrics.exposition())
    assert value(scraped, "vllm:num_requests_running") == 3 and value(scraped, "vllm:num_requests_waiting") == 2
    assert value(scraped, "vllm:gpu_cache_usage_perc") == 3 / 8
    assert value(scraped, "vllm:gpu_prefix_cache_queries_total") == 100
    assert value(scraped, "vllm:gpu_prefix_cache_hits_total") == 40
    engine.state["prefix_cache"].update(queried_tokens=164, hit_tokens=90)
    engine.state["slots"].update(busy=0, free=8)
    scraped = samples(metrics.exposition())
    assert value(scraped, "vllm:gpu_prefix_cache_queries_total") == 164
    assert value(scraped, "vllm:gpu_prefix_cache_hits_total") == 90
    assert value(scraped, "vllm:num_requests_running") == 0 and value(scraped, "vllm:gpu_cache_usage_perc") == 0
    assert value(scraped, "vllm:num_preemptions_total") == 0
    engine.state["requests"]["preempted"] = 3
    assert value(samples(metrics.exposition()), "vllm:num_preemptions_total") == 3


def test_an_engine_without_a_prefix_cache_reports_no_prefix_cache_counters():
    scraped = samples(ServingMetrics(FakeEngine(prefix_cache=False).stats, "m").exposition())
    assert not any("prefix_cache" in name for name, _ in scraped)
    assert value(scraped, "vllm:num_requests_waiting") == 2


def test_apps_in_one_process_keep_their_own_registries():
    first, second = ServingMetrics(FakeEngine().stats, "a"), ServingMetrics(FakeEngine().stats, "b")
    first.timer(GenerationRequest([1, 2], 4, print)).on_event(Event("x", (7,), finish_reason="length"))
    assert value(samples(first.exposition()), "vllm:generation_tokens_total") == 1
    assert value(samples(second.exposition()), "vllm:generation_tokens_total") == 0


def test_a_request_timer_counts_tokens_and_finish_reasons_and_times_streamed_requests_only():
    metrics = ServingMetrics(FakeEngine().stats, "m")
    streamed = metrics.timer(GenerationRequest([1, 2, 3], 8, print, stream=True))
    for event in (Event("a", (5, 6)), Event("b", (7,)), Event("c", (8,), finish_reason="stop")):
        streamed.on_event(event)
    whole = metrics.timer(GenerationRequest([1, 2], 8, print))
    whole.on_event(Event("abc", (5, 6, 7), finish_reason="length"))
    metrics.timer(GenerationRequest([1], 8, print)).on_event(Event(error="the engine failed"))
    scraped = samples(metrics.exposition())
    assert value(scraped, "vllm:prompt_tokens_total") == 5 and value(scraped, "vllm:generation_tokens_total") == 7
    assert value(scraped, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(scraped, "vllm:request_success_total", finished_reason="length") == 1
    assert value(scraped, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(scraped, "vllm:time_to_first_token_seconds_count") == 1
    assert value(scraped, "vllm:time_per_output_token_seconds_count") == 1
    assert value(scraped, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 2


@pytest.fixture(scope="module")
def url():
    with tiny_server(model_name="tiny-metrics", api_key=KEY) as running:
        yield running


def scrape(url: str) -> dict:
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


def test_metrics_need_the_api_key(url):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{url}/metrics", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_counters_move_after_requests_on_every_generating_route(url):
    before = scrape(url)
    assert value(before, "vllm:num_requests_running") == 0 and value(before, "vllm:gpu_cache_usage_perc") == 0
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    done = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0}).json()
    chunks = list(client.chat.completions.create(model="tiny-metrics", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert http.post("/complete", json={"context": "Once", "length": 2, "temp": 0}).status_code == 200
    http.close()
    after = scrape(url)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    usages = [done["usage"], chunks[-1].usage.model_dump()]
    prompt_tokens = sum(u["prompt_tokens"] for u in usages) + len(load_tokenizer().encode("Once"))
    generated = sum(u["completion_tokens"] for u in usages) + 2  # /complete's length
    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:generation_tokens_total") == generated
    finished = {reason: moved("vllm:request_success_total", finished_reason=reason) for reason in ("stop", "length")}
    assert sum(finished.values()) == 3
    assert moved("vllm:e2e_request_latency_seconds_count") == 3
    assert moved("vllm:time_to_first_token_seconds_count") == 1  # the streamed chat only
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    if ("vllm:gpu_prefix_cache_queries_total", ()) in after:  # an engine with a prefix cache
        assert value(after, "vllm:gpu_prefix_cache_queries_total") >= value(after, "vllm:gpu_prefix_cache_hits_total")
