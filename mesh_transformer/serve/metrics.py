"""The server's Prometheus metrics under vLLM's names, each labelled model_name, in one registry per app.

Read from the engine when scraped (`engine.stats()`):
- vllm:num_requests_running      gauge: requests in slots (prefilling or decoding)
- vllm:num_requests_waiting      gauge: requests queued for a slot
- vllm:gpu_cache_usage_perc      gauge: the fraction (0 to 1, as vLLM's) of KV-cache slots busy (a slot holds one
                                 request's whole context), or with a paged cache of its pages held by requests
- vllm:num_preemptions_total     counter: requests preempted where a paged cache ran out of pages (each resumed)
- vllm:gpu_prefix_cache_queries  counter: prompt tokens looked up in the prefix cache (when the engine has one)
- vllm:gpu_prefix_cache_hits     counter: of those, tokens whose cached keys were reused
- vllm:lora_requests_info        gauge (where LoRA adapters are served): labels running_lora_adapters (the names
                                 requests are running) and max_lora (the slots)

Counted where requests finish, per engine request (one choice: a request with n > 1 or several prompts makes
several), by `RequestTimer`, which every generating route's requests go through, labelled with the model the request
named (the base's name, or a served LoRA adapter's):
- vllm:prompt_tokens_total                      prompt tokens prefilled (counted at a request's first event)
- vllm:generation_tokens_total                  tokens generated and handed to the client
- vllm:request_success_total{finished_reason}   finished requests: "stop" (EOS or a stop string) or "length"
- vllm:e2e_request_latency_seconds              histogram: submitted to finished
- vllm:time_to_first_token_seconds              histogram: submitted to the first tokens sent; streamed requests
                                                only (the engine hands a non-streamed request its text at the end)
- vllm:time_per_output_token_seconds            histogram: after the first tokens, seconds per further token;
                                                streamed requests only
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mesh_transformer.serve.completion import Event, GenerationRequest

# vLLM's buckets
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class EngineCollector:
    """The engine's state, read at each scrape from `stats()` (the engine's, or anything with the same dict)."""

    def __init__(self, stats: Callable[[], dict], model_name: str):
        self._stats, self._labels = stats, [model_name]

    def _family(self, kind: type, name: str, documentation: str, value: float) -> Metric:
        family = kind(name, documentation, labels=["model_name"])
        family.add_metric(self._labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        slots = stats["slots"]
        yield self._family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in slots (prefill or decode).",
                           slots["busy"])
        yield self._family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting for a slot.",
                           stats["queue"]["waiting"])
        pages = stats.get("pages")  # a paged cache: the pages held by requests, else the slots busy
        usage = (1 - pages["available"] / pages["total"]) if pages else slots["busy"] / max(1, slots["total"])
        yield self._family(GaugeMetricFamily, "vllm:gpu_cache_usage_perc",
                           "Fraction of the KV cache in use: pages held, or slots busy (1 means all).", usage)
        yield self._family(CounterMetricFamily, "vllm:num_preemptions",
                           "Requests preempted when the paged cache ran out of pages (resumed later).",
                           stats["requests"]["preempted"])
        prefix = stats.get("prefix_cache")
        if prefix is not None:
            yield self._family(CounterMetricFamily, "vllm:gpu_prefix_cache_queries",
                               "Prompt tokens looked up in the prefix cache.", prefix["queried_tokens"])
            yield self._family(CounterMetricFamily, "vllm:gpu_prefix_cache_hits",
                               "Prompt tokens whose cached keys were reused.", prefix["hit_tokens"])


class ServingMetrics:
    """One app's metrics: its own registry (apps in one process do not clash), the request counters and latency
    histograms that RequestTimers feed, each labelled with the model a request named (the base, or a served LoRA
    adapter), and the engine's state read at scrape time."""

    def __init__(self, stats: Callable[[], dict], model_name: str, adapters: Callable[[], dict] | None = None):
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labelled = {"labelnames": ["model_name"], "registry": registry}
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled.", **labelled)
        self._generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", **labelled)
        self._success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=registry)
        self._time_to_first_token_s = Histogram(
            "vllm:time_to_first_token_seconds", "Seconds to the first tokens of a streamed request.",
            buckets=TTFT_BUCKETS_S, **labelled)
        self._time_per_output_token_s = Histogram(
            "vllm:time_per_output_token_seconds", "Seconds per token after the first, of a streamed request.",
            buckets=TPOT_BUCKETS_S, **labelled)
        self._e2e_request_latency_s = Histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from a request's submission to its end.",
            buckets=E2E_BUCKETS_S, **labelled)
        self.of(model_name)  # the base's series exist from the start
        registry.register(EngineCollector(stats, model_name))
        if adapters is not None:
            registry.register(AdapterCollector(adapters))

    def of(self, model: str) -> ModelMetrics:
        """The series of one model name (made on first use)."""
        return ModelMetrics(self._prompt_tokens.labels(model), self._generation_tokens.labels(model),
                            {reason: self._success.labels(model, reason) for reason in FINISH_REASONS},
                            self._time_to_first_token_s.labels(model), self._time_per_output_token_s.labels(model),
                            self._e2e_request_latency_s.labels(model))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def timer(self, request: GenerationRequest, model: str | None = None) -> RequestTimer:
        """A timer started now for a request about to be submitted, counted under `model` (default: the base)."""
        return RequestTimer(self.of(model or self.model_name), len(request.prompt), request.stream)


@dataclasses.dataclass(frozen=True)
class ModelMetrics:
    """One model name's series."""
    prompt_tokens: Any
    generation_tokens: Any
    success: dict
    time_to_first_token_s: Any
    time_per_output_token_s: Any
    e2e_request_latency_s: Any


class AdapterCollector:
    """vLLM's vllm:lora_requests_info gauge: the LoRA adapters requests are running (comma-separated names) and the
    slots served, as labels, from `info()` = {"running": [...], "max_lora": N}."""

    def __init__(self, info: Callable[[], dict]):
        self._info = info

    def collect(self) -> Iterator[Metric]:
        info = self._info()
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running LoRA adapters and the adapter slots served.",
                                   labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
        family.add_metric([",".join(info["running"]), str(info["max_lora"]), ""], time.time())
        yield family


class RequestTimer:
    """One engine request's times and tokens: fed its events (on the engine thread, as they are made), it counts
    and observes into the metrics as they happen."""

    def __init__(self, metrics: ModelMetrics, prompt_tokens: int, streamed: bool):
        self.metrics, self.prompt_tokens, self.streamed = metrics, prompt_tokens, streamed
        self.submitted_s = time.perf_counter()
        self.first_s: float | None = None
        self.first_tokens = self.tokens = 0

    def on_event(self, event: Event) -> None:
        if event.error:
            return
        now_s, metrics = time.perf_counter(), self.metrics
        if self.first_s is None:  # its prefill is done
            self.first_s, self.first_tokens = now_s, len(event.tokens)
            metrics.prompt_tokens.inc(self.prompt_tokens)
            if self.streamed:
                metrics.time_to_first_token_s.observe(now_s - self.submitted_s)
        self.tokens += len(event.tokens)
        metrics.generation_tokens.inc(len(event.tokens))
        if event.finish_reason is None:
            return
        metrics.e2e_request_latency_s.observe(now_s - self.submitted_s)
        if event.finish_reason in metrics.success:
            metrics.success[event.finish_reason].inc()
        later_tokens = self.tokens - self.first_tokens
        if self.streamed and later_tokens > 0:
            metrics.time_per_output_token_s.observe((now_s - self.first_s) / later_tokens)
