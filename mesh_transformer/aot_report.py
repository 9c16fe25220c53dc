"""The fit check's report (aot.py): the verdict record (does the largest per-device need fit a device's memory?) and
the lines a person reads.
"""
from __future__ import annotations

from mesh_transformer.aot_compile import size_text


def verdict(records: list[dict], device_memory: int) -> dict:
    """The fit record: the largest per-device need of the programs against one device's memory (with several
    training modes, each mode's train step with the inference programs). Where the server's own verdict is among
    them (aot_check.py with its flags), it stands for inference: the other inference records are the slot cache's
    and the sampler's at a whole context per slot, which a paged server does not run."""
    server = [r for r in records if r["check"] == "server"]
    counted = [r for r in records if "train_step" in r["check"]] + server if server else records
    inference = max((r["total_bytes"] for r in counted if "train_step" not in r["check"]), default=0)
    by_mode = {r["mode"]: max(r["total_bytes"], inference) for r in counted if "train_step" in r["check"]}
    need = max(by_mode.values(), default=inference)
    first = records[0]
    refused = [r["check"] for r in counted if "refused" in r]  # a program the compiler would not make does not fit
    largest = max(counted, key=lambda r: r["total_bytes"])["check"]
    return {"check": "fit", "mode": first.get("mode"), "mesh": first.get("mesh"), "devices": first.get("devices"),
            "per_device_need_bytes": need, "largest": largest, "device_memory_bytes": device_memory,
            "fits": need <= device_memory and not refused, "refused": refused,
            "fits_by_mode": {mode: n <= device_memory for mode, n in by_mode.items()}}


def _train_line(train: dict) -> str:
    mesh = " x ".join(f"{k}{v}" for k, v in train["mesh"].items())
    kind = f"LoRA rank {train['lora_rank']} train step" if "lora_rank" in train else "train step"
    line = (f"{train['mode']} on {mesh}: {kind} {size_text(train['total_bytes'])} per device (params "
            f"{size_text(train['params_bytes'])}, optimizer {size_text(train['opt_state_bytes'])}, temporaries "
            f"{size_text(train['temp_bytes'])}; compiled in {train['compile_s']:.0f} s)")
    if "refused" in train:
        line += f"; the compiler refused it: {train['refused']}"
    if "estimated_step_s" in train:
        line += (f", estimated {train['estimated_step_s']:.2f} s per step, {train['estimated_tokens_per_s']:,.0f} "
                 f"tokens/s, MFU {100 * train['estimated_mfu']:.0f}% (an estimate from the compiler's cost model)")
    if "estimated_collective_s" in train:
        line += (f"; its collectives {size_text(train['collective_bytes'])} a device, "
                 f"{train['estimated_collective_s']:.2f} s over ICI: "
                 f"{train['estimated_tokens_per_s_with_collectives']:,.0f} tokens/s if none overlapped")
    return line


def human_line(records: list[dict]) -> str:
    """What a person reads: one line per train step, one for serving, one for the verdict."""
    fit = records[-1]
    trains = [r for r in records if "train_step" in r["check"]]
    lines = [_train_line(r) for r in trains]
    if decode := next((r for r in records if r["check"] == "serve_decode_step"), None):
        line = (f"serving decode step {size_text(decode['total_bytes'])} for {decode['slots']} slots (params "
                f"{size_text(decode['params_bytes'])}, KV cache {size_text(decode['kv_cache_bytes'])})")
        if "estimated_step_s" in decode:
            line += (f", estimated {1e3 * decode['estimated_step_s']:.1f} ms a step, "
                     f"{decode['estimated_tokens_per_s']:,.0f} tokens/s with every slot busy over the whole context")
        lines.append(line)
    if paged := next((r for r in records if r["check"] == "serve_paged_decode_step"), None):
        request = "+".join(map(str, paged["request_tokens"]))
        lines.append(f"paged serving ({paged['kv_cache_dtype']} cache, pages of {paged['page_size']}): "
                     f"{size_text(paged['per_page_bytes'])} a page; requests of {request} tokens that fit: "
                     + ", ".join(f"{k}: {v}" for k, v in paged["requests_that_fit"].items()))
    if server := next((r for r in records if r["check"] == "server"), None):
        lines.append(f"device_serve.py --max-batch {server['max_batch']}: refused: {server['refused']}"
                     if "refused" in server else
                     f"device_serve.py --max-batch {server['max_batch']}: "
                     + (f"{server['kv_pages']} pages of {server['page_size']} ({server['kv_cache_dtype']})"
                        if server["kv_pages"] else "the slot cache")
                     + f", {size_text(server['total_bytes'])} of the {size_text(server['budget_bytes'])} allowed "
                       f"(the largest program {server['largest_program']})")
    lines += [f"{r['check']}: the compiler refused it: {r['refused']}" for r in records[:-1]
              if "refused" in r and r["check"] != "server" and "train_step" not in r["check"]]
    first = records[0]
    lines.append(f"on {first['target']} ({first['compiler']}): {'fits' if fit['fits'] else 'does NOT fit'} in "
                 f"{size_text(fit['device_memory_bytes'])} (the largest need: {fit['largest']}, "
                 f"{size_text(fit['per_device_need_bytes'])})")
    return "\n".join(lines)
