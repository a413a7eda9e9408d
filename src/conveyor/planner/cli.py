"""``conveyor plan``: how many KV tokens and sequences a model fits on a device, and how fast
it can decode there. Also runnable as ``python -m conveyor.planner.cli``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import Any

from conveyor.config import ModelConfig, max_tensor_parallel_size
from conveyor.planner.models import resolve_model
from conveyor.planner.plan import (
    DTYPE_BYTES,
    CapacityPlan,
    DeviceSpec,
    ParallelPlan,
    dtype_bytes,
    kv_dtype_scale_bytes,
    kv_heads_per_device,
    plan_capacity,
    plan_parallel,
)
from conveyor.planner.presets import (
    DEVICE_PRESETS,
    GB,
    LINK_PRESETS,
    MODEL_PRESETS,
    TFLOP,
    default_link_name,
    device_preset,
    link_preset,
)

DEFAULT_ACTIVATION_RESERVE = "5%"  # of device memory: 4 GB on an 80 GB device
DEFAULT_SEQ_LEN = 1000
DEFAULT_DTYPE = "float16"

_HELP = """\
Plan KV-cache capacity: weight memory, KV bytes per token, the KV tokens and concurrent
sequences that fit after the weights and an activation reserve, the device's ops:byte
ratio, the decode tokens/s roofline at --batch, the batch where decode turns
compute-bound, and the fewest tensor-parallel devices that hold the model. With
--tensor-parallel-size N and/or --replicas R: KV tokens and sequences per replica, the
all-reduce cost per decode step over the link (--link), and decode tokens/s per replica
and over all replicas.
Sizes are decimal: 1 GB = 1e9 bytes, as device datasheets quote them."""


def parse_activation_reserve(text: str) -> float:
    """``"5%"`` or ``"0.05"`` -> a fraction of memory; ``"6GB"`` or ``"6"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(%|GB)?\s*", text,
                     flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--activation-reserve must be a fraction (0.05), a percentage (5%) "
                         f"or GB (6GB), got {text!r}")
    number, unit = float(m.group(1)), (m.group(2) or "").upper()
    if unit == "%":
        if number >= 100:
            raise ValueError(f"--activation-reserve must be below 100%, got {text!r}")
        return number / 100
    if unit == "GB" or number >= 1:
        return number * GB
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``conveyor plan``."""
    parser.add_argument("--model", required=True,
                        help="an HF config.json (or its folder), a .gguf file, or a preset: "
                             + ", ".join(MODEL_PRESETS))
    parser.add_argument("--device", default=None,
                        help="a preset (" + ", ".join(DEVICE_PRESETS) + "), or 'this' to "
                             "measure this machine (~2 s); --memory-gb/--bandwidth-gbs/"
                             "--tflops override single figures, or give all three instead")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="device memory in GB (1e9 bytes)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="memory bandwidth in GB/s")
    parser.add_argument("--tflops", type=float, default=None,
                        help="dense bf16/fp16 matmul TFLOP/s")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE,
                        help=f"weight dtype: {', '.join(DTYPE_BYTES)} (default {DEFAULT_DTYPE})")
    parser.add_argument("--kv-dtype", default=None,
                        help="KV cache dtype, same choices (default: --dtype)")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                        help=f"average tokens per sequence, prompt + output "
                             f"(default {DEFAULT_SEQ_LEN})")
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences decoded together, for the decode bound and the "
                             "KV that --tp planning must hold (default 1)")
    parser.add_argument("--activation-reserve", default=DEFAULT_ACTIVATION_RESERVE,
                        help="memory kept per device for activations, workspace and the "
                             "runtime: a fraction (0.05), a percentage (5%%) or GB (6GB); a "
                             "bare number >= 1 is GB (default 5%%: 4 GB of an 80 GB A100, "
                             "leaving Llama-2-7B fp16 ~62 GB = ~119k tokens of KV)")
    parser.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=int, default=1,
                        help="devices one model copy is split over, as the engine splits it: "
                             "at most the model's KV heads, which need not divide evenly "
                             "(default 1)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="model copies (each on --tensor-parallel-size devices): totals "
                             "are per replica times this (default 1)")
    parser.add_argument("--link", default=None,
                        help="device-to-device link for the all-reduces: "
                             + ", ".join(LINK_PRESETS) + " (default: the device's usual one, "
                             "pcie4 when unknown)")
    parser.add_argument("--link-gbs", type=float, default=None,
                        help="link bandwidth in GB/s, one direction (instead of --link)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the table")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` sub-command to the ``conveyor`` command line."""
    parser = subparsers.add_parser("plan", help="plan KV-cache capacity on a device",
                                   description=_HELP,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def resolve_device(args: argparse.Namespace) -> DeviceSpec:
    """The device from ``--device`` and/or ``--memory-gb``, ``--bandwidth-gbs``, ``--tflops``."""
    overrides = {"memory_bytes": args.memory_gb, "bandwidth_bytes_per_s": args.bandwidth_gbs,
                 "flops_per_s": args.tflops}
    if args.device is None:
        if None in overrides.values():
            raise ValueError("--device: give a preset (" + ", ".join(DEVICE_PRESETS) + "), "
                             "'this', or all of --memory-gb, --bandwidth-gbs and --tflops")
        return DeviceSpec(name="custom", memory_bytes=args.memory_gb * GB,
                          bandwidth_bytes_per_s=args.bandwidth_gbs * GB,
                          flops_per_s=args.tflops * TFLOP)
    if args.device.lower() == "this":
        from conveyor.planner.measure import measure_this_machine  # imports torch

        device = measure_this_machine()
    else:
        device = device_preset(args.device)
    scale = {"memory_bytes": GB, "bandwidth_bytes_per_s": GB, "flops_per_s": TFLOP}
    given = {k: v * scale[k] for k, v in overrides.items() if v is not None}
    return dataclasses.replace(device, **given) if given else device


def resolve_link(args: argparse.Namespace, device: DeviceSpec) -> tuple[str, float]:
    """The all-reduce link: (name, bytes/s) from --link-gbs, --link, or the device's."""
    if args.link_gbs is not None:
        if args.link is not None:
            raise ValueError("--link and --link-gbs both given: give one")
        if not args.link_gbs > 0:
            raise ValueError(f"--link-gbs must be > 0, got {args.link_gbs!r}")
        return "custom", args.link_gbs * GB
    name = args.link or default_link_name(device.name)
    return name.lower(), link_preset(name)


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / GB:,.2f} GB"


def _decode_line(plan: CapacityPlan, which: str) -> str:
    bound = plan.decode if which == "requested" else plan.decode_at_max_concurrency
    if bound is None:
        return "no sequence fits"
    return (f"{bound.tokens_per_s:,.0f} tok/s  (batch {bound.batch}, step "
            f"{bound.step_time_s * 1e3:.2f} ms, {bound.bound}-bound)")


def _tok_s(value: float | None) -> str:
    return "no sequence fits" if value is None else f"{value:,.0f} tok/s"


def parallel_rows(config: ModelConfig, device: DeviceSpec, dtype: str, plan: CapacityPlan,
                  par: ParallelPlan) -> list[tuple[str, str]]:
    """The table's rows for --tensor-parallel-size and --replicas."""
    ar = par.allreduce_bytes_per_token_per_layer
    return [
        ("replicas x tensor parallel", f"{par.replicas} x {par.tp} = {par.num_devices} x "
         f"{device.name}"),
        ("KV tokens per replica", f"{par.kv_tokens_per_replica:,}  ({par.seqs_per_replica:,} "
         f"sequences of {plan.seq_len:,} tokens; {par.seqs_total:,} in all)"),
        ("all-reduce link", f"{par.link}, {par.link_bytes_per_s / GB:,.0f} GB/s one direction"),
        ("all-reduce per token", f"{par.allreduces_per_layer} x {config.num_hidden_layers} "
         f"layers x {ar:,.0f} B  (2 x ({par.tp}-1)/{par.tp} x {config.hidden_size} hidden x "
         f"{dtype_bytes(dtype)} B ({dtype}) per all-reduce)"),
        ("all-reduce per decode step", f"{par.allreduce_time_s * 1e3:.3f} ms at batch "
         f"{plan.decode.batch}" + ("" if par.allreduce_time_at_max_s is None else
                                   f"; {par.allreduce_time_at_max_s * 1e3:.3f} ms with the KV "
                                   "full")),
        ("decode bound per replica", f"{_tok_s(par.tokens_per_s_per_replica)}  (batch "
         f"{plan.decode.batch}, step {par.decode_step_s * 1e3:.2f} ms with the all-reduce)"),
        ("decode bound, all replicas", _tok_s(par.tokens_per_s_total)),
        ("  with the KV full", f"{_tok_s(par.tokens_per_s_per_replica_at_max)} per replica, "
         f"{_tok_s(par.tokens_per_s_total_at_max)} in all"),
    ]


def format_table(name: str, config: ModelConfig, device: DeviceSpec, dtype: str,
                 kv_dtype: str, plan: CapacityPlan, par: ParallelPlan | None = None) -> str:
    """The plan as an aligned, human-readable table (GB = 1e9 bytes)."""
    per_dev = " per device" if plan.tp > 1 else ""
    heads = kv_heads_per_device(config, plan.tp)
    weights_only = f"{plan.compute_bound_batch_weights_only:,.0f} counting weight reads only"
    crossover = (f"never at --seq-len {plan.seq_len} (a sequence's KV reads outlast its "
                 f"FLOPs); {weights_only}" if plan.compute_bound_batch is None
                 else f"{plan.compute_bound_batch:,.0f}  ({weights_only})")
    if plan.min_tp is None:
        tp_line = (f"none: the engine splits this model at most "
                   f"{max_tensor_parallel_size(config)} ways (its KV heads and MLP)")
    else:
        split = ("divides" if plan.min_tp_divides_kv_heads
                 else "splits unevenly: the rank with the most holds "
                      f"{kv_heads_per_device(config, plan.min_tp)} of")
        tp_line = (f"{plan.min_tp} x {device.name}  (weights + {plan.decode.batch} x "
                   f"{plan.seq_len} tokens of KV; {split} {config.num_key_value_heads} KV heads)")
    rows = [
        ("parameters", f"{plan.num_parameters / 1e9:,.2f} B"),
        (f"weights ({dtype})", _gb(plan.weight_bytes)
         + (f"  ({_gb(plan.weight_bytes_per_device)} per device)" if plan.tp > 1 else "")),
        (f"activation reserve{per_dev}", _gb(plan.activation_reserve_bytes)),
        (f"KV budget{per_dev}", _gb(plan.kv_budget_bytes)
         + ("" if plan.weights_fit else "  (weights do not fit: raise --tp)")),
        (f"KV per token ({kv_dtype})",
         f"{plan.kv_bytes_per_token:,} B = {config.num_hidden_layers} layers x "
         f"{config.num_key_value_heads} KV heads x 2 (K,V) x ({config.head_dim} head_dim x "
         f"{dtype_bytes(kv_dtype, '--kv-dtype')} B{_scale_term(kv_dtype)})"),
        *([(f"KV per token{per_dev}", f"{plan.kv_bytes_per_token_per_device:,} B "
            f"({heads} KV heads)")] if plan.tp > 1 else []),
        ("KV tokens that fit", f"{plan.kv_tokens:,}"),
        (f"sequences of {plan.seq_len:,} tokens", f"{plan.max_concurrent_seqs:,}"),
        ("ops:byte", f"{plan.ops_per_byte:,.1f} FLOP/B"),
        ("decode bound", _decode_line(plan, "requested")),
        ("decode bound, KV full", _decode_line(plan, "max")),
        ("compute-bound from batch", crossover),
        ("tensor parallel needed", tp_line),
        *(parallel_rows(config, device, dtype, plan, par) if par is not None else []),
    ]
    width = max(len(label) for label, _ in rows)
    header = (f"{name} on {plan.tp} x {device.name}: {_gb(device.memory_bytes)}, "
              f"{device.bandwidth_bytes_per_s / GB:,.0f} GB/s, "
              f"{device.flops_per_s / TFLOP:,.1f} TFLOP/s   (GB = 1e9 bytes)")
    return "\n".join([header, *(f"  {label:<{width}}  {value}" for label, value in rows)])


def to_json(name: str, device: DeviceSpec, dtype: str, kv_dtype: str,
            plan: CapacityPlan, par: ParallelPlan | None = None) -> dict[str, Any]:
    """The plan as one JSON-ready dict: inputs first, then every ``CapacityPlan`` field,
    and the ``ParallelPlan`` under "parallel"."""
    return {"model": name, "device": dataclasses.asdict(device), "dtype": dtype,
            "kv_dtype": kv_dtype, **dataclasses.asdict(plan),
            "parallel": None if par is None else dataclasses.asdict(par)}


def _scale_term(kv_dtype: str) -> str:
    scale = kv_dtype_scale_bytes(kv_dtype)
    return f" + {scale} B scale" if scale else ""


def run(args: argparse.Namespace) -> int:
    """Run ``conveyor plan``; 0 on success, 2 (with a message on stderr) on bad input."""
    try:
        name, config = resolve_model(args.model)
        device = resolve_device(args)
        kv_dtype = args.kv_dtype or args.dtype
        plan = plan_capacity(config, device, dtype_bytes(args.dtype, "--dtype"),
                             dtype_bytes(kv_dtype, "--kv-dtype"), args.seq_len, args.batch,
                             parse_activation_reserve(str(args.activation_reserve)),
                             tp=args.tp, kv_scale_bytes=kv_dtype_scale_bytes(kv_dtype))
        link, link_bytes = resolve_link(args, device)
        par = plan_parallel(config, plan, dtype_bytes(args.dtype), args.replicas, link,
                            link_bytes)
    except ValueError as err:
        print(f"conveyor plan: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(to_json(name, device, args.dtype, kv_dtype, plan, par), indent=2))
    else:
        shown = par if args.tp > 1 or args.replicas > 1 else None
        print(format_table(name, config, device, args.dtype, kv_dtype, plan, shown))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m conveyor.planner.cli [flags]``: the same as ``conveyor plan [flags]``."""
    parser = argparse.ArgumentParser(prog="conveyor plan", description=_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
