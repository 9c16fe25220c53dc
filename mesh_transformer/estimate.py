"""Step-time estimates from a compiled program, for targets this machine can compile for but not run.

XLA's cost analysis (`flops`, `bytes accessed`, and on TPU `optimal_seconds`) counts the body of a while loop once:
the 6B train step's layer scan and micro-step scan each look like one trip. `loop_flops` reads the optimized HLO's
loop structure instead: each computation's matrix-product FLOPs (dot, convolution, cuBLAS gemm), multiplied by the
trip counts of the loops around it (XLA's `known_trip_count` where it wrote one, else the loop condition's bound).
The estimate scales XLA's own once-counted figures by the ratio of the two counts, so it is XLA's roofline with the
loops counted: an estimate, not a measurement (no overlap, collectives or host time modelled beyond XLA's own).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
_CALLED = re.compile(r"(?:calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _dims(shape: str) -> list[int]:
    match = _SHAPE.match(shape)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


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


def _gemm_flops(out_shape: str, shapes: dict, operands: list[str], rest: str) -> float:
    match = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
    if not match or not operands or operands[0] not in shapes:
        return 0.0
    lhs = _dims(shapes[operands[0]])
    contracting = [int(d.strip('" ')) for d in match.group(1).split(",") if d.strip('" ')]
    out = _dims(out_shape.lstrip("("))  # a tuple (result, workspace): the first is the product
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


class _Module:
    """The optimized HLO text of one program: per computation its matrix FLOPs, what it calls, its while loops."""

    def __init__(self, text: str):
        self.flops: dict[str, float] = defaultdict(float)
        self.calls: dict[str, list[tuple[str, str]]] = defaultdict(list)  # computation -> [(callee, while name)]
        self.lines: dict[str, list[str]] = defaultdict(list)
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
            self.flops[current] += self._flops(opcode, shape, shapes, rest)
            loop = name if opcode == "while" else ""
            for callee in _CALLED.findall(rest):
                self.calls[current].append((callee, loop))
            for branches in _BRANCHES.findall(rest):
                self.calls[current] += [(b.strip().lstrip("%"), "") for b in branches.split(",")]

    @staticmethod
    def _flops(opcode: str, shape: str, shapes: dict, rest: str) -> float:
        operands = _operands(rest)
        if opcode == "dot" and operands and operands[0] in shapes:
            return _dot_flops(_dims(shape), _dims(shapes[operands[0]]), rest)
        if opcode == "convolution" and len(operands) > 1 and operands[1] in shapes:
            return _conv_flops(_dims(shape), _dims(shapes[operands[1]]), rest)
        if opcode == "custom-call" and re.search(r'custom_call_target="[^"]*(gemm|matmul)', rest):
            return _gemm_flops(shape, shapes, operands, rest)
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

    def weighted(self) -> tuple[float, float]:
        """(FLOPs with each loop's trip count, FLOPs with each reachable computation counted once)."""
        times: dict[str, float] = defaultdict(float)
        once: set[str] = set()

        def visit(name: str, factor: float, depth: int = 0) -> None:
            if depth > 64:
                return
            times[name] += factor
            once.add(name)
            for callee, loop in self.calls[name]:
                visit(callee, factor * (self.trip_count(name, loop) if loop else 1), depth + 1)

        visit(self.entry, 1.0)
        return sum(self.flops[n] * t for n, t in times.items()), sum(self.flops[n] for n in once)


def loop_flops(hlo_text: str) -> tuple[float, float]:
    """(matrix FLOPs of one run of the program, loops counted by their trips; the same with every loop body counted
    once, as XLA's cost analysis counts them), per device, from the optimized HLO text."""
    return _Module(hlo_text).weighted()


def _layer_params(cfg) -> int:
    return cfg.layers * (4 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * cfg.d_ff)


def model_flops_per_token(cfg, lora: bool = False) -> float:
    """Training FLOPs per token by the usual count (PaLM's): 6 per matrix parameter (forward 2, backward 4) plus
    causal attention's 6 * 2 * L * T * D (scores and weighted sum), without remat's recompute. A LoRA step forms no
    gradient of the frozen weights: 4 per parameter (the adapters' few are left out)."""
    per_param = 4.0 if lora else 6.0
    return (per_param * (_layer_params(cfg) + cfg.d_model * cfg.n_vocab)
            + per_param * 2 * cfg.layers * cfg.seq * cfg.d_model)


def executed_flops_per_token(cfg, remat: bool) -> float:
    """The matrix FLOPs a full train step runs per token: the model FLOPs (XLA's attention computes the masked scores
    too, as that count has it) and, with remat, a second forward of the products whose outputs the backward reads
    (q, k, v, fc_in and attention; the out and fc_out products' outputs are not read, so XLA drops their
    recompute)."""
    d, layers = cfg.d_model, cfg.layers
    recompute = 2.0 * layers * (3 * d * d + d * cfg.d_ff) + 4.0 * layers * cfg.seq * d if remat else 0.0
    return model_flops_per_token(cfg) + recompute


def step_estimate(compiled, peak_flops: float, bandwidth: float, tokens: int, model_flops: float) -> dict:
    """Estimated seconds, tokens/s and MFU of one run of a compiled step on devices of this peak (FLOP/s) and
    memory bandwidth (bytes/s) each. `tokens`: the step's, all devices'; `model_flops`: one device's share."""
    weighted, once = loop_flops(compiled.as_text())
    scale = weighted / once if once else 1.0
    cost = compiled.cost_analysis() or {}  # None on GPU
    cost = cost[0] if isinstance(cost, list) else cost
    if cost.get("optimal_seconds", 0) > 0:
        xla_s = scale * float(cost["optimal_seconds"])
    else:
        xla_s = scale * float(cost.get("bytes accessed", 0.0)) / bandwidth
    seconds = max(weighted / peak_flops, xla_s)
    return {"estimated_flops": weighted, "xla_counted_flops": float(cost.get("flops", 0.0)),
            "loop_scale": round(scale, 2), "estimated_step_s": seconds,
            "estimated_tokens_per_s": tokens / seconds, "estimated_mfu": model_flops / (seconds * peak_flops)}
