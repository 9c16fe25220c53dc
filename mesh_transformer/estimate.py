"""Step-time estimates from a compiled program, for targets this machine can compile for but not run.

XLA's cost analysis (`flops`, `bytes accessed`, and on TPU `optimal_seconds`) counts the body of a while loop once:
the 6B train step's layer scan and micro-step scan each look like one trip, and its figures cannot be scaled as a
whole (the optimizer update outside the loops would be multiplied too). So this module reads the optimized HLO
itself: each computation's matrix-product FLOPs (dot, convolution, cuBLAS gemm) and each scheduled instruction's
memory traffic (its operands and result; a slice of a stacked array counts as the slice, an in-place update as the
update), multiplied by the trip counts of the loops around it (XLA's `known_trip_count` where it wrote one, else the
loop condition's bound). The estimated time is the sum over instructions of max(FLOPs / peak, bytes / bandwidth), a
per-instruction roofline at the rates the chip attains where they were measured on one (`targets.Chip.attained`),
else at its datasheet's (`step_estimate` gives its measured error on a v5e chip): an estimate, not a measurement.
Collectives are counted apart (`_Module.collective_bytes`): the bytes a device sends in a ring algorithm over each
collective's group, at the chip's ICI bandwidth (`targets.Chip.ici_bandwidth`), added to the step as if none
overlapped compute (an upper bound of their cost). The host is not modelled.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

from mesh_transformer.infer import decode_kernel

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
_SHAPE_ALL = re.compile(r"\w+\[[\d,]*\]")
_CALLED = re.compile(r"(?:calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_ARRAY_LAYOUT = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\}|)")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# Instructions that move no data of their own (or whose work is their called computations').
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "iota"}
_SLICES = {"dynamic-slice", "slice"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_GROUPS_LISTED = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")


def _group_size(rest: str) -> int:
    """The devices in each group of a collective's replica_groups (listed, iota [groups, size], or mesh axes)."""
    if match := _GROUPS_LISTED.search(rest):
        return len(match.group(1).split(","))
    if match := _GROUPS_IOTA.search(rest):
        return int(match.group(2))
    if match := _GROUPS_MESH.search(rest):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", match.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", match.group(2)))
    return 1


def _collective_bytes(opcode: str, shape: str, shapes: dict, operands: list[str], rest: str) -> float:
    """Bytes one device sends in a ring algorithm for one collective instruction (0 for others): an all-reduce of N
    bytes 2 (g - 1) / g N over a group of g, an all-gather to N or a reduce-scatter from N (g - 1) / g N, a
    permute N."""
    kind = opcode.removesuffix("-start")
    if kind not in _COLLECTIVES:
        return 0.0
    result = sum(_bytes(s, vmem=True) for s in _SHAPE_ALL.findall(shape))  # wherever they lie (a core's VMEM too)
    inputs = sum(_bytes(shapes[o], vmem=True) for o in operands if o in shapes)
    if kind == "collective-permute":
        return float(inputs)
    g = _group_size(rest)
    if g < 2:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (g - 1) / g * inputs
    if kind == "all-gather":
        return (g - 1) / g * (result - inputs if opcode.endswith("-start") else result)
    return (g - 1) / g * inputs  # reduce-scatter, all-to-all


def _dims(shape: str) -> list[int]:
    match = _SHAPE.match(shape)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _bytes(shape: str, vmem: bool = False) -> int:
    """Bytes of an array or tuple shape in device memory: arrays XLA:TPU placed in a core's VMEM (memory space 1,
    `S(1)` in their layout) move no device-memory bytes, unless `vmem` (what is moved into VMEM was read)."""
    return sum(_DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims, layout in _ARRAY_LAYOUT.findall(shape) if vmem or "S(1)" not in layout)


def _field(rest: str, name: str) -> list[int]:
    match = re.search(name + r"=\{([\d,]*)\}", rest)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])


def _dot_flops(out: list[int], lhs: list[int], rest: str) -> float:
    contracting = _field(rest, "lhs_contracting_dims")
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _conv_flops(out: list[int], rhs: list[int], rest: str) -> float:
    """A matrix product XLA:TPU wrote as a convolution: each output element sums over the kernel's input features.
    Its window dims are batch dims laid out as a window (a batched dot), not a sum, so they do not multiply."""
    match = re.search(r"dim_labels=\w+_(\w+)->\w+", rest)
    if not match:
        return 0.0
    return 2.0 * math.prod(out) * math.prod(size for label, size in zip(match.group(1), rhs) if label == "i")


# JAX's splash attention kernels (`model.attention.splash_attention`), by the name XLA gives their calls: the matrix
# products of q's shape by the keys' length each runs (forward: scores, weighted sum; dq: scores, the probabilities'
# gradient, dq; dkv: those two, dk and dv). Pallas calls carry no FLOPs XLA can see.
_SPLASH_PRODUCTS = {"splash_mha_fwd": 2, "splash_mha_dq": 3, "splash_mha_dkv": 4}


def _splash_flops(name: str, shapes: dict, operands: list[str]) -> float:
    """A splash kernel's FLOPs (operands: two mask tables, then q and k [..., heads, positions, head dim]): its
    products over the causal blocks it computes (of n blocks a side, n (n + 1) / 2), 0 for any other Pallas call."""
    from mesh_transformer.model.attention import splash_block

    kind = next((k for k in _SPLASH_PRODUCTS if name.startswith(k)), None)
    if kind is None or len(operands) < 4 or operands[2] not in shapes or operands[3] not in shapes:
        return 0.0
    q, keys = _dims(shapes[operands[2]]), _dims(shapes[operands[3]])[-2]
    blocks = keys // splash_block(keys)
    return _SPLASH_PRODUCTS[kind] * 2.0 * math.prod(q) * keys * (blocks + 1) / (2 * blocks)


def _operand_bytes(name: str, shapes: dict, operands: list[str]) -> int:
    """The device-memory bytes an instruction reads of its operands: all of them, but of the decode attention
    kernel's cache blocks [N, S_j, H, K] (its operands after the lengths, the chunk counts and the queries [R, H, K])
    the first R slots only."""
    sizes = [_bytes(shapes.get(o, "")) for o in operands]
    if not name.startswith(decode_kernel.NAME) or len(operands) < 4:
        return sum(sizes)
    rows = (_dims(shapes.get(operands[2], "")) or [0])[0]
    slots = [(_dims(shapes.get(o, "")) or [1])[0] for o in operands[3:]]
    return sum(sizes[:3]) + sum(size * min(1, rows / n) for size, n in zip(sizes[3:], slots))


def _gemm_flops(out_shape: str, shapes: dict, operands: list[str], rest: str) -> float:
    match = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
    if not match or not operands or operands[0] not in shapes:
        return 0.0
    lhs = _dims(shapes[operands[0]])
    contracting = [int(d.strip('" ')) for d in match.group(1).split(",") if d.strip('" ')]
    out = _dims(out_shape.lstrip("("))  # a tuple (result, workspace): the first is the product
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _update(opcode: str, operands: list) -> str | None:
    """The operand an in-place update writes into its first operand: a dynamic-update-slice's update, a scatter's
    updates (one array scattered); None for any other instruction."""
    if opcode == "dynamic-update-slice":
        return operands[1]
    return operands[2] if opcode == "scatter" and len(operands) == 3 else None


class _Module:
    """The optimized HLO text of one program: per computation its matrix FLOPs, what it calls, its while loops."""

    def __init__(self, text: str):
        self.flops: dict[str, float] = defaultdict(float)
        self.calls: dict[str, list[tuple[str, str]]] = defaultdict(list)  # computation -> [(callee, while name)]
        self.lines: dict[str, list[str]] = defaultdict(list)
        self.instructions: dict[str, list[tuple[str, str, str, list[str]]]] = defaultdict(list)
        self.fused: set[str] = set()  # computations a fusion calls: their instructions touch no memory of their own
        self.entry = ""
        current, shapes = "", {}
        for line in re.sub(r"/\*.*?\*/", "", text).splitlines():  # /*index=5*/ inside tuple shapes
            header = _COMPUTATION.match(line)
            if header:
                current, shapes = header.group(1), {}
                self.entry = current if line.startswith("ENTRY") else self.entry
                continue
            match = _INSTRUCTION.match(line)
            if not match or not current:
                continue
            name, shape, opcode, rest = match.groups()
            shapes[name] = shape
            self.lines[current].append(line)
            self.instructions[current].append((name, shape, opcode, _operands(rest)))
            if opcode == "fusion":
                self.fused.update(re.findall(r"calls=%?([\w.\-]+)", rest))
            self.flops[current] += self._flops(opcode, shape, shapes, rest, name)
            loop = name if opcode == "while" else ""
            for callee in _CALLED.findall(rest):
                self.calls[current].append((callee, loop))
            for branches in _BRANCHES.findall(rest):
                self.calls[current] += [(b.strip().lstrip("%"), "") for b in branches.split(",")]

    @staticmethod
    def _flops(opcode: str, shape: str, shapes: dict, rest: str, name: str = "") -> float:
        operands = _operands(rest)
        if opcode == "dot" and operands and operands[0] in shapes:
            return _dot_flops(_dims(shape), _dims(shapes[operands[0]]), rest)
        if opcode == "convolution" and len(operands) > 1 and operands[1] in shapes:
            return _conv_flops(_dims(shape), _dims(shapes[operands[1]]), rest)
        if opcode == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)', rest):
            return _gemm_flops(shape, shapes, operands, rest)
        if opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in rest:
            return _splash_flops(name, shapes, operands)
        return 0.0

    def trip_count(self, computation: str, loop: str) -> int:
        """The trip count of while `loop` in `computation`: XLA's known_trip_count, else the bound its condition
        compares the counter with, minus the counter's start where that is a constant."""
        line = self._defining(computation, loop)
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        if known:
            return int(known.group(1))
        condition = re.search(r"condition=%?([\w.\-]+)", line).group(1)
        bounds = [int(c) for x in self._reachable_lines(condition)
                  for c in re.findall(r"s32\[\][^=]*? constant\((-?\d+)\)", x)]
        if len(bounds) != 1:
            return 1  # not a counted loop this reader understands: counted once, as XLA does
        return max(1, bounds[0] - self._counter_start(computation, line, condition))

    def _counter_start(self, computation: str, while_line: str, condition: str) -> int:
        """The loop counter's first value: the element of the loop's initial tuple that the condition reads, where
        that is a constant integer (through copies), else 0."""
        index = re.search(r"get-tuple-element\(.*\), index=(\d+)", "\n".join(self.lines[condition]))
        init = _operands(while_line.split(" while(", 1)[1])
        element = self._defining(computation, init[0]) if init else ""
        if not index or " tuple(" not in element:
            return 0
        elements = _operands(element.split(" tuple(", 1)[1])
        name = elements[int(index.group(1))] if int(index.group(1)) < len(elements) else ""
        for _ in range(8):
            line = self._defining(computation, name)
            if " copy(" in line:
                name = _operands(line.split(" copy(", 1)[1])[0]
                continue
            constant = re.search(r"= s32\[\][^=]* constant\((-?\d+)\)", line)
            return int(constant.group(1)) if constant else 0
        return 0

    def _defining(self, computation: str, name: str) -> str:
        return next((x for x in self.lines[computation] if re.match(rf"^\s*(?:ROOT )?%?{re.escape(name)} = ", x)), "")

    def _reachable_lines(self, computation: str) -> list[str]:
        seen, todo, out = set(), [computation], []
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                out += self.lines[name]
                todo += [callee for callee, _ in self.calls[name]]
        return out

    def times(self) -> dict[str, float]:
        """How many times one run of the program runs each computation (loops by their trip counts)."""
        times: dict[str, float] = defaultdict(float)

        def visit(name: str, factor: float, depth: int = 0) -> None:
            if depth > 64:
                return
            times[name] += factor
            for callee, loop in self.calls[name]:
                visit(callee, factor * (self.trip_count(name, loop) if loop else 1), depth + 1)

        visit(self.entry, 1.0)
        return times

    def weighted(self) -> tuple[float, float]:
        """(FLOPs with each loop's trip count, FLOPs with each reachable computation counted once)."""
        times = self.times()
        return sum(self.flops[n] * t for n, t in times.items()), sum(self.flops[n] for n in times)

    def roofline_s(self, peak_flops: float, bandwidth: float) -> float:
        """Seconds of one run: over the scheduled (unfused) instructions, max(FLOPs / peak, bytes / bandwidth)
        each, times the runs of their computation."""
        return self.times_s(peak_flops, bandwidth)[0]

    def times_s(self, peak_flops: float, bandwidth: float) -> tuple[float, float, float]:
        """(the per-instruction roofline's seconds, all FLOPs / peak, all bytes / bandwidth) of one run."""
        seconds = compute_s = memory_s = 0.0
        for computation, runs in self.times().items():
            if computation in self.fused:
                continue
            shapes = {name: shape for name, shape, _, _ in self.instructions[computation]}
            for name, shape, opcode, operands in self.instructions[computation]:
                if opcode in _FREE or any(c in opcode for c in ("all-", "reduce-scatter", "collective", "send",
                                                                "recv")):
                    continue
                flops, traffic = self._instruction_cost(shape, opcode, operands, shapes, computation, name)
                seconds += runs * max(flops / peak_flops, traffic / bandwidth)
                compute_s += runs * flops / peak_flops
                memory_s += runs * traffic / bandwidth
        return seconds, compute_s, memory_s

    def collective_bytes(self) -> float:
        """Bytes one device sends in the collectives of one run (`_collective_bytes`), loops by their trip counts."""
        total = 0.0
        for computation, runs in self.times().items():
            shapes = {name: shape for name, shape, _, _ in self.instructions[computation]}
            for line, (_, shape, opcode, operands) in zip(self.lines[computation], self.instructions[computation]):
                total += runs * _collective_bytes(opcode, shape, shapes, operands, line)
        return total

    def _instruction_cost(self, shape, opcode, operands, shapes, computation, name) -> tuple[float, float]:
        """(FLOPs, bytes read and written) of one scheduled instruction."""
        if opcode in _SLICES:
            return 0.0, 2.0 * _bytes(shape)
        if opcode.endswith("-done"):  # an asynchronous op's traffic is its start's
            return 0.0, 0.0
        if opcode == "slice-start":  # its result tuple holds the whole operand (aliased) and the slice it reads
            return 0.0, max(0, _bytes(shape, vmem=True) - _bytes(shapes.get(operands[0], ""), vmem=True))
        if opcode == "copy-start":  # (destination, source, context): the source read, the destination written
            return 0.0, float(_bytes(shape))  # where it is device memory (a prefetch into VMEM writes none)
        if update := _update(opcode, operands):  # in place: the update read and written
            return 0.0, 2.0 * _bytes(shapes.get(update, ""))
        if opcode != "fusion":
            line = self._defining(computation, name)
            return self._flops(opcode, shape, shapes, line.split(f" {opcode}(", 1)[-1], name), \
                _bytes(shape) + _operand_bytes(name, shapes, operands)
        fused = re.search(r"calls=%?([\w.\-]+)", self._defining(computation, name)).group(1)
        reads = sum(self._parameter_reads(fused, i, shapes.get(o, "")) for i, o in enumerate(operands))
        return self._fused_flops(fused), reads + self._fusion_writes(fused, shape)

    def _fused_flops(self, computation: str) -> float:
        nested = [c for line in self.lines[computation] if " fusion(" in line
                  for c in re.findall(r"calls=%?([\w.\-]+)", line)]
        return self.flops[computation] + sum(self._fused_flops(c) for c in nested)

    def _parameter_reads(self, fused: str, index: int, shape: str) -> float:
        """Bytes a fusion reads of its operand `index`: the slices where it only slices it (here or in a fusion it
        calls), nothing where it only updates it in place (a dynamic-update-slice or scatter into it), else the whole
        operand."""
        instructions = self.instructions[fused]
        parameter = next((n for n, _, op, _ in instructions if op == "parameter" and re.search(
            rf"parameter\({index}\)", self._defining(fused, n))), None)
        reads = 0.0
        for name, user_shape, opcode, operands in instructions:
            if parameter not in operands:
                continue
            if opcode in _SLICES:
                reads += _bytes(user_shape)
            elif _update(opcode, operands) and operands[0] == parameter:
                continue
            elif opcode == "fusion":
                nested = re.search(r"calls=%?([\w.\-]+)", self._defining(fused, name)).group(1)
                reads += self._parameter_reads(nested, operands.index(parameter), shape)
            else:
                return _bytes(shape)
        return min(reads, _bytes(shape)) if parameter is not None else _bytes(shape)

    def _fusion_writes(self, fused: str, shape: str) -> float:
        """Bytes a fusion writes: its result, but for an in-place update (through bitcasts; a dynamic-update-slice or
        a scatter, the KV cache's) only the update."""
        by_name = {n: (s, op, ops) for n, s, op, ops in self.instructions[fused]}
        root = next((line for line in self.lines[fused] if line.lstrip().startswith("ROOT ")), "")
        match = _INSTRUCTION.match(root)
        if not match:
            return _bytes(shape)
        root_name = match.group(1)
        _, opcode, operands = by_name[root_name]
        parts = operands if opcode == "tuple" else [root_name]

        def written(name: str) -> float:
            part_shape, op, ops = by_name.get(name, ("", "", []))
            if op == "bitcast" and ops:
                return written(ops[0])
            update = _update(op, ops)
            return _bytes(by_name.get(update, ("",))[0]) if update else _bytes(part_shape)

        return sum(written(part) for part in parts)


def loop_flops(hlo_text: str) -> tuple[float, float]:
    """(matrix FLOPs of one run of the program, loops counted by their trips; the same with every loop body counted
    once, as XLA's cost analysis counts them), per device, from the optimized HLO text."""
    return _Module(hlo_text).weighted()


def layer_matrix_params(cfg) -> int:
    """The layers' matrix params: q and out D x D each, k and v D x (key heads x K) each, the MLP's two matrices of
    D x F (three where it is gated)."""
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    return cfg.layers * (2 * d * d + 2 * d * kv + _mlp_matrices(cfg) * d * cfg.d_ff)


def _mlp_matrices(cfg) -> int:
    from mesh_transformer.model import families

    return 3 if families.of(cfg).block.mlp == "swiglu" else 2


def model_flops_per_token(cfg, lora: bool = False) -> float:
    """Training FLOPs per token by the usual count (PaLM's): 6 per matrix parameter (forward 2, backward 4) plus
    causal attention's 6 * 2 * L * T * D (scores and weighted sum), without remat's recompute. A LoRA step forms no
    gradient of the frozen weights: 4 per parameter (the adapters' few are left out)."""
    per_param = 4.0 if lora else 6.0
    return (per_param * (layer_matrix_params(cfg) + cfg.d_model * cfg.n_vocab)
            + per_param * 2 * cfg.layers * cfg.seq * cfg.d_model)


def executed_flops_per_token(cfg, remat: bool) -> float:
    """The matrix FLOPs a full train step runs per token: the model FLOPs (XLA's attention computes the masked scores
    too, as that count has it) and, with remat, a second forward of the products whose outputs the backward reads
    (q, k, v, fc_in and attention; the out and fc_out products' outputs are not read, so XLA drops their
    recompute; remat_policy "save_qkv" keeps q, k and v's, "save_mlp_hidden" fc_in's)."""
    d, layers = cfg.d_model, cfg.layers
    kept = cfg.remat_policy  # a kept product's output is not recomputed
    qkv = d * d + 2 * d * cfg.kv_heads * cfg.head_dim
    products = (0 if kept == "save_qkv" else qkv) + (0 if kept == "save_mlp_hidden" else
                                                     (_mlp_matrices(cfg) - 1) * d * cfg.d_ff)
    recompute = 2.0 * layers * products + 4.0 * layers * cfg.seq * d if remat else 0.0
    return model_flops_per_token(cfg) + recompute


def step_estimate(compiled, chip, tokens: int, model_flops: float) -> dict:
    """Estimated seconds, tokens/s and MFU of one run of a compiled step on devices of `chip`'s kind
    (`targets.Chip`: its datasheet's peak FLOP/s and bandwidth, and the fractions of them it attains). `tokens`: the
    step's, all devices'; `model_flops`: one device's share.

    The step's time is the sum over its scheduled instructions of max(FLOPs / attained peak, bytes / attained
    bandwidth), an instruction's bytes being those it moves in device memory (not a TPU core's VMEM; an asynchronous
    slice or copy counted once, at its start; an in-place update, the KV cache's, as its update). Against one v5e
    chip (bench/estimate_check.py over bench/results/) it read 0.88 of a 10-layer d_model 2048 full-training step
    (16 x 2048 tokens, splash attention), 0.98-1.00 of GPT-J-6B's LoRA step, 1.01 / 1.04 of its bf16 decode step at
    batch 1 / 16 and 1.00 / 1.03 / 1.01 of its int8 decode step at batch 1 / 32 / 64 (docs/performance.md).
    `estimated_compute_s` and `estimated_memory_s` are the two sums apart; `estimated_mfu` is against the datasheet's
    peak. Where the chip's ICI bandwidth is known, `collective_bytes` (what a device sends in the step's
    collectives), `estimated_collective_s` (those bytes at that bandwidth) and
    `estimated_tokens_per_s_with_collectives` (none overlapping the rest: a lower bound)."""
    module = _Module(compiled.as_text())
    weighted, once = module.weighted()
    cost = compiled.cost_analysis() or {}  # None on GPU
    cost = cost[0] if isinstance(cost, list) else cost
    seconds, compute_s, memory_s = module.times_s(chip.peak_flops * chip.attained[0],
                                                  chip.bandwidth * chip.attained[1])
    record = {"estimated_flops": weighted, "xla_counted_flops": float(cost.get("flops", 0.0)),
              "estimated_compute_s": compute_s, "estimated_memory_s": memory_s,
              "loop_scale": round(weighted / once, 2) if once else 1.0, "estimated_step_s": seconds,
              "estimated_tokens_per_s": tokens / seconds, "estimated_mfu": model_flops / (seconds * chip.peak_flops)}
    if chip.ici_bandwidth:
        sent = module.collective_bytes()
        with_collectives = seconds + sent / chip.ici_bandwidth
        record.update(collective_bytes=sent, estimated_collective_s=sent / chip.ici_bandwidth,
                      estimated_tokens_per_s_with_collectives=tokens / with_collectives)
    return record
