"""Compiles one engine step program for an H200 on a machine without a GPU, and says, per buffer allocation of
the compiled program, how many commands of its command buffer (the CUDA graph XLA runs it as) touch it.

Why: before each run XLA re-records every command that touches an allocation whose address moved since the last
run (docs/architecture.md, section 7). The step's per-step inputs, its outputs that are not donated, and its
scratch can move; this says how many commands each one costs when it does, without a GPU lease.

    python tools/deviceless_step.py --key 1,0,0 --dump /tmp/step_dump

Needs an environment with the CUDA plugin and pip's ptxas besides the project's (nothing runs on a device):

    python3.12 -m venv /tmp/aot && /tmp/aot/bin/pip install -c constraints.txt . \\
        jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2 "nvidia-cuda-nvcc>=13,<14" "nvidia-nvjitlink>=13,<14" \\
        "nvidia-cuda-runtime>=13,<14" "nvidia-nvvm>=13,<14"
    /tmp/aot/bin/pip install tokamax==0.0.17   # the prefill attention of programs with prompt chunks
    JAX_PLATFORMS=cpu /tmp/aot/bin/python tools/deviceless_step.py ...

XLA autotunes nothing without a device, so GEMMs take its default configs: the kernels of the Pallas calls and
the fusions are those of the GPU, a GEMM's tiles and the scratch size may differ from a real compile.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
from functools import partial

# An H200 as XLA's GPU compiler sees it (sm_90a): the device's published limits.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 }
device_description_str: "NVIDIA H200"
"""


def compile_step(key: tuple[int, int, int], preset: str, max_batch: int, num_pages: int, page_table_width: int):
    """The engine's step program of bucket `key` (B, P, T) at the preset's shapes, compiled for the H200 as the
    runner compiles it (GPU weight layout, the pallas kernel set, donated caches, its XLA options)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from qwen35_jax.batch import DecodeSide, InputLayout, PrefillSide, StepInputs
    from qwen35_jax.cache import Cache, CacheSpec
    from qwen35_jax.config import preset as model_preset
    from qwen35_jax.kernels import mixers
    from qwen35_jax.model import abstract_model
    from qwen35_jax.serving.runner import _step_on_leaves, gpu_step_options

    device = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H200_TARGET).devices[0]
    jax.config.update("jax_default_device", device)  # Pallas' Triton lowering reads the default device's kind
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    cfg = model_preset(preset)
    model_def, params = abstract_model(cfg, jnp.bfloat16)
    leaves, group_def = jax.tree.flatten(params["groups"])  # per-group arrays, as `layout_for_platform` on a GPU
    groups = tuple(jax.tree.unflatten(group_def, [abstract(leaf.shape[1:], leaf.dtype) for leaf in leaves])
                   for _ in range(leaves[0].shape[0]))  # fmt: skip
    params = {**jax.tree.map(lambda s: abstract(s.shape, s.dtype), params), "groups": groups}
    param_leaves, treedef = jax.tree.flatten(params)
    slots = max_batch + 1
    spec = CacheSpec(num_pages, 16, slots, "float32")
    cache = Cache(**{name: abstract(s.shape, s.dtype) for name, s in spec.shapes(cfg, jnp.bfloat16).items()})
    b, p, t = key
    decode = DecodeSide(
        None, *(abstract((b,), jnp.int32) for _ in range(2)), abstract((b, page_table_width), jnp.int32)
    )
    prefill = PrefillSide(abstract((p, t), jnp.int32), *(abstract((p,), jnp.int32) for _ in range(3)),
                          abstract((p, page_table_width), jnp.int32))  # fmt: skip
    layout = InputLayout.of(StepInputs(decode if b else None, prefill if p else None))
    step = jax.jit(partial(_step_on_leaves, treedef, model_def, mixers("pallas")), static_argnums=(4,),
                   donate_argnums=(1, 2))  # fmt: skip
    packed = abstract((layout.size,), jnp.int32)
    lowered = step.trace(param_leaves, cache, abstract((slots,), jnp.int32), packed, layout).lower()
    return lowered.compile(gpu_step_options(key) or None), len(param_leaves)


@dataclasses.dataclass
class Allocation:
    size: int
    attributes: str
    values: list = dataclasses.field(default_factory=list)

    @property
    def parameter(self) -> int | None:
        found = re.search(r"parameter (\d+)", self.attributes)
        return int(found.group(1)) if found else None

    @property
    def kind(self) -> str:
        if self.parameter is not None:
            return "parameter" + (", donated" if "maybe-live-out" in self.attributes else "")
        if "preallocated-temp" in self.attributes:
            return "scratch"
        if "constant" in self.attributes or "thread-local" in self.attributes:
            return "constant"
        return "output" if "maybe-live-out" in self.attributes else "other"


def read_allocations(text: str) -> tuple[dict[int, Allocation], dict[tuple[str, str], int]]:
    """XLA's buffer assignment dump -> allocations, and (HLO value, tuple index) -> allocation."""
    allocations, owner, current = {}, {}, None
    for line in text.splitlines():
        head = re.match(r"allocation (\d+): size (\d+), (.*)", line)
        if head:
            current = int(head.group(1))
            allocations[current] = Allocation(int(head.group(2)), head.group(3))
            continue
        value = re.match(r" value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))?(?: @\d+)?> \(size=\d+,offset=\d+\)", line)
        if value and current is not None:
            owner[(value.group(1), value.group(2) or "")] = current
            allocations[current].values.append(value.group(1))
        elif line and not line.startswith(" "):
            current = None
    return allocations, owner


def read_entry(hlo: str) -> dict[str, dict]:
    """The optimized HLO's entry computation: instruction -> {op, operands, line}."""
    instructions = {}
    for line in hlo[hlo.index("\nENTRY") :].splitlines()[1:]:
        found = re.match(r"\s+(?:ROOT )?%(\S+) = (.*)", line)
        if not found:
            continue
        name, rest = found.groups()
        rest = _after_shape(rest)
        start = rest.index("(")
        operands = _balanced(rest, start)
        names = [a.strip()[1:] for a in re.sub(r"/\*.*?\*/", "", operands).split(",") if a.strip().startswith("%")]
        instructions[name] = {"op": rest[:start], "operands": names, "line": line}
    return instructions


def _after_shape(rest: str) -> str:
    if not rest.startswith("("):
        return rest.split(" ", 1)[1]
    return rest[len(_balanced(rest, 0)) + 3 :]


def _balanced(text: str, start: int) -> str:
    """The text inside the parenthesis that opens at `start`."""
    depth = 0
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return text[start + 1 : end]
    raise ValueError(f"unbalanced: {text[start : start + 80]}")


def command_allocations(dump: str) -> tuple[dict[int, Allocation], list[tuple[str, set[int]]], dict[int, str]]:
    """Per command of the program's command buffers (one per kernel thunk), the allocations it reads or writes."""
    first = lambda pattern: open(glob.glob(os.path.join(dump, pattern))[0]).read()  # noqa: E731
    allocations, owner = read_allocations(first("*after_optimizations-buffer-assignment.txt"))
    instructions = read_entry(first("*after_optimizations.txt"))
    meta = first("*thunk_metadata.txt")

    def resolve(ref: str) -> set[int]:
        name, _, index = ref.partition("#")
        instruction = instructions.get(name)
        if instruction is None:
            return set()
        if instruction["op"] == "bitcast":
            return resolve(instruction["operands"][0])
        if instruction["op"] == "get-tuple-element":
            element = re.search(r"index=(\d+)", instruction["line"]).group(1)
            return resolve(f"{instruction['operands'][0]}#{element}")
        if instruction["op"] == "tuple":
            parts = [instruction["operands"][int(index)]] if index else instruction["operands"]
            return set().union(*(resolve(part) for part in parts))
        if (name, f"{{{index}}}" if index else "") in owner:
            return {owner[(name, f"{{{index}}}" if index else "")]}
        return {owner[k] for k in owner if k[0] == name and k[1] not in ("", "{}")}

    commands = []
    for block in meta.split("thunk_metadata {")[1:]:
        kind = re.search(r'thunk_kind: "([^"]+)"', block).group(1)
        name = re.search(r'profile_annotation: "([^"]+)"', block)
        if kind in ("kCommandBuffer", "kSequential") or name is None or name.group(1) not in instructions:
            continue
        instruction = instructions[name.group(1)]
        used = set().union(set(), *(resolve(operand) for operand in instruction["operands"]))
        used |= {owner[k] for k in owner if k[0] == name.group(1) and k[1] not in ("{}",)}
        commands.append((name.group(1), used))
    parameters = {int(m.group(2)): m.group(1) for m in re.finditer(r"%(\S+) = \S+ parameter\((\d+)\)", first(
        "*after_optimizations.txt"))}  # fmt: skip
    return allocations, commands, parameters


def report(dump: str, num_weights: int) -> str:
    allocations, commands, parameters = command_allocations(dump)
    touching = collections.Counter(index for _, used in commands for index in used)
    lines = [f"{len(commands)} commands", "", "| allocation | bytes | kind | what | commands touching it |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    weights = 0
    for index, allocation in sorted(allocations.items()):
        if allocation.kind == "constant" or not touching[index]:
            continue
        if allocation.parameter is not None and allocation.parameter < num_weights:
            weights += 1
            continue
        what = parameters.get(allocation.parameter, "") if allocation.parameter is not None else (
            f"{len(allocation.values)} values")  # fmt: skip
        lines.append(f"| {index} | {allocation.size} | {allocation.kind} | {what} | {touching[index]} |")
    # What may move between runs: outputs the program does not alias to a donated input, the scratch, and the
    # per-step inputs (parameters past the weights that are not donated).
    moving = {i for i, a in allocations.items() if a.kind in ("output", "scratch")
              or (a.kind == "parameter" and a.parameter >= num_weights)}  # fmt: skip
    scratch = {i for i, a in allocations.items() if a.kind == "scratch"}
    lines += ["", f"weights: {weights} allocations, each touched by its own few commands",
              f"commands touching a per-step input or an output that is not donated: "
              f"{sum(1 for _, used in commands if used & (moving - scratch))}",
              f"... or the scratch: {sum(1 for _, used in commands if used & moving)}"]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--key", default="1,0,0", help="the step bucket B,P,T (decode rows, prefill rows, chunk)")
    parser.add_argument("--preset", default="4b")
    parser.add_argument("--max-batch", type=int, default=64, help="GDN slots are this + 1")
    parser.add_argument("--num-pages", type=int, default=65536, help="KV pool pages (sizes only, not structure)")
    parser.add_argument("--page-table-width", type=int, default=512)
    parser.add_argument("--dump", required=True, help="folder for XLA's dumps (emptied first)")
    args = parser.parse_args(argv)
    for old in glob.glob(os.path.join(args.dump, "*")):
        os.remove(old)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.dump}"
    key = tuple(int(x) for x in args.key.split(","))
    _, num_weights = compile_step(key, args.preset, args.max_batch, args.num_pages, args.page_table_width)
    print(f"step program {key}, {args.preset}, compiled for an H200 without a device")
    print(report(args.dump, num_weights))


if __name__ == "__main__":
    main()
