"""The server's sizing on the chip (serve/sizing.py): the pages `--kv-pages auto` takes within a budget, and what the
compiler said the largest program needs, hold on the device: serving requests over those pages never takes the
chip's memory past what was in use before plus the sized need (the code of the programs it runs included: a TPU keeps
each one's code in its memory once run)."""
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.serve import sizing
from mesh_transformer.serve.engine import Engine
from mesh_transformer.tokenizer import load_tokenizer
from tests.device.model import CFG
from tests.device.test_serving import prompts_with_shared_prefixes, serve_together

BUDGET_BYTES = 256 << 20  # a small budget: the auto pages then fill it at this model's size (its 22 programs' code
# is about 105 MiB of it on a v5e)
PAGE = 16


def test_auto_pages_serve_within_the_sized_need(chip):
    from tests.device.model import trained_scale_params

    layout = make_inference_layout(CFG, mesh=make_dp_mp(1, 1, [chip]))
    programs = Programs(layout)
    device_bytes, reported = sizing.device_memory([chip])
    fit = sizing.for_server(programs, max_batch=8, n_pages="auto", page_size=PAGE, prefix_cache=True,
                            memory_fraction=BUDGET_BYTES / device_bytes, device_bytes=device_bytes)
    assert fit.need_bytes <= fit.budget_bytes and fit.n_pages >= 8 * CFG.seq // PAGE
    before = chip.memory_stats() or {}
    engine = Engine(layout, trained_scale_params(), load_tokenizer(), max_batch=8, programs=programs,
                    n_pages=fit.n_pages, page_size=PAGE, stop_token_ids=())
    try:
        prompts = prompts_with_shared_prefixes(16, seed=2)
        events = serve_together(engine, prompts, [CFG.seq - len(p) for p in prompts])
    finally:
        engine.close()
    assert all(request[-1].finish_reason == "length" for request in events)
    if reported:  # the CPU under MTJ_DEVICE_TIER_ON_CPU reports none
        # The peak is the process's: past what it was before, serving took at most its sized need beyond what was
        # in use then.
        peak = chip.memory_stats()["peak_bytes_in_use"]
        assert peak <= max(before["peak_bytes_in_use"], before["bytes_in_use"] + fit.need_bytes), fit.summary()
