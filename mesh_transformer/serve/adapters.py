"""The LoRA adapters a server serves by name over its base, as vLLM does (`--lora-modules NAME=PATH`, the request's
`model` picks one, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` at run time): each loaded adapter holds one
of the engine's adapter slots (`max_loras`, model/lora_slots.py), written there between two decode steps, so nothing
recompiles. An adapter is unloaded at once for new requests; its slot is cleared and freed when the last request
running it ends.

Adapters come from a LoRA run of ours or an HF PEFT directory, local or gs:// (`store.adapters.read_adapters`),
checked against the base (family, shapes) and the served rank.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from mesh_transformer.config import ConfigError
from mesh_transformer.serve import api
from mesh_transformer.serve.api import ApiError
from mesh_transformer.store.adapters import read_adapters

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Adapter:
    """A loaded adapter: its name, where it came from, its slot and the key its cached prefixes go under."""
    name: str
    path: str
    slot: int
    key: int
    rank: int
    created: int


class AdapterSlots:
    """The adapters served by name: which slot each holds, how many requests run each slot."""

    def __init__(self, engine, base_name: str):
        self.engine, self.cfg, self.base_name = engine, engine.cfg, base_name
        self._lock = threading.Lock()
        self._by_name: dict[str, Adapter] = {}
        self._free = list(range(self.cfg.max_loras))
        self._users = [0] * self.cfg.max_loras
        self._leaving: set[int] = set()  # slots of unloaded adapters that requests still run
        self._keys = 0
        self.loaded_total = 0

    # ------------------------------------------------------------------------------------------- names and loads
    def names(self) -> list[Adapter]:
        with self._lock:
            return list(self._by_name.values())

    def load(self, name: str, path: str) -> Adapter:
        """Read the adapter at `path` and write it into a free slot (blocking: run it off the event loop). An
        ApiError (400) names what is wrong: the name taken, an unreadable or mismatched adapter, no free slot."""
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "'lora_name' and 'lora_path' must be non-empty strings")
        with self._lock:
            if name == self.base_name or name in self._by_name:
                raise ApiError(400, f"the model name {name!r} is already served; unload it first", "lora_name")
        start_s = time.perf_counter()
        try:
            adapters, scale = read_adapters(path, self.cfg)
        except (ConfigError, FileNotFoundError, ValueError, OSError) as e:
            raise ApiError(400, f"adapter {name!r} at {path}: {e}", "lora_path") from None
        rank = next(iter(adapters.values()))["a"].shape[-1]
        if rank > self.cfg.max_lora_rank:
            raise ApiError(400, f"adapter {name!r} has rank {rank}, over the served maximum {self.cfg.max_lora_rank} "
                                f"(--max-lora-rank)", "lora_path")
        with self._lock:
            if name in self._by_name:
                raise ApiError(400, f"the model name {name!r} is already served; unload it first", "lora_name")
            if not self._free:
                raise ApiError(400, f"all {self.cfg.max_loras} adapter slots are taken (--max-loras); unload one "
                                    f"first", "lora_name")
            slot = self._free.pop(0)
            self._keys += 1
            adapter = Adapter(name, path, slot, self._keys, rank, int(time.time()))
        try:
            self.engine.write_adapter(slot, adapters, scale).result()
        except BaseException:
            with self._lock:
                self._free.insert(0, slot)
            raise
        with self._lock:
            self._by_name[name] = adapter
            self.loaded_total += 1
        log.info("loaded LoRA adapter %s (rank %d) from %s into slot %d in %.2f s", name, rank, path, slot,
                 time.perf_counter() - start_s)
        return adapter

    def unload(self, name: str) -> None:
        """Serve `name` no more: new requests for it get a 404 at once; its slot is cleared once the requests
        running it have ended."""
        with self._lock:
            adapter = self._by_name.pop(name, None) if isinstance(name, str) else None
            if adapter is None:
                raise ApiError(404, f"The model `{name}` does not exist.", "lora_name", code="model_not_found")
            self._leaving.add(adapter.slot)
            idle = self._users[adapter.slot] == 0
        if idle:
            self._clear(adapter.slot)

    # ------------------------------------------------------------------------------------------------- requests
    def acquire(self, model: str | None, n: int = 1) -> tuple[int, int]:
        """(slot, prefix key) of the model a request names (the base: (-1, 0)), counted `n` times as running it until
        `release`; an unknown name is OpenAI's 404."""
        if model is None or model == self.base_name:
            return -1, 0
        with self._lock:
            adapter = self._by_name.get(model)
            if adapter is None:
                raise ApiError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")
            self._users[adapter.slot] += n
            return adapter.slot, adapter.key

    def check(self, model: str | None) -> None:
        """OpenAI's 404 where `model` is neither the base nor a served adapter."""
        self.release(*self.acquire(model)[:1])

    def release(self, slot: int, n: int = 1) -> None:
        """`n` requests of `slot` have ended; an unloaded adapter's slot is cleared after its last."""
        if slot < 0:
            return
        with self._lock:
            self._users[slot] -= n
            idle = self._users[slot] == 0 and slot in self._leaving
        if idle:
            self._clear(slot)

    def info(self) -> dict:
        """The adapters requests are running, and the slots served (metrics.py's vllm:lora_requests_info)."""
        with self._lock:
            running = [a.name for a in self._by_name.values() if self._users[a.slot]]
        return {"running": running, "max_lora": self.cfg.max_loras}

    def _clear(self, slot: int) -> None:
        """Clear a slot no request runs and free it: the engine runs its calls in order, so an adapter loaded into
        the slot later is written after the clear."""
        try:
            self.engine.write_adapter(slot, None)
        except Exception as e:  # a stopped engine: nothing runs there any more
            log.warning("clearing adapter slot %d: %s", slot, e)
        with self._lock:
            self._leaving.discard(slot)
            self._free.append(slot)


def add_adapter_routes(app: FastAPI, body: Callable[[Request], Awaitable[dict]], authorized: list,
                       adapters: AdapterSlots) -> None:
    """vLLM's /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}; `body`
    reads a request's JSON object (the server's limits)."""

    @app.post("/v1/load_lora_adapter", dependencies=authorized)
    async def load_lora_adapter(request: Request) -> Response:
        fields = await body(request)
        api.check_fields(fields, {"lora_name", "lora_path"}, {})
        adapter = await asyncio.to_thread(adapters.load, fields.get("lora_name"), fields.get("lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=authorized)
    async def unload_lora_adapter(request: Request) -> Response:
        fields = await body(request)
        api.check_fields(fields, {"lora_name", "lora_int_id"}, {})
        adapters.unload(fields.get("lora_name"))
        return PlainTextResponse(f"Success: LoRA adapter '{fields['lora_name']}' removed successfully.")
