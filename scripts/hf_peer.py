"""HF transformers ``generate`` as the peer of ``conveyor bench offline``: the same built-in
shape (random weights), the same workload's requests, the same single stream.

    PYTHONPATH=src python scripts/hf_peer.py --model qwen3-0.6b --workload nano-vllm \
        --batch-size 256 --device cuda --result-file peer.json

``generate`` has no continuous batching: the requests, sorted by output length, run in
batches of ``--batch-size`` (prompts left-padded), each batch generating its longest
request's tokens (EOS off); the throughput counts the tokens the requests asked for, over
the whole time. The single stream: one request of ``SingleStream().prompt_len`` tokens, its
first token timed alone (TTFT), then ``max_tokens``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

import torch

from conveyor.bench.offline import WORKLOADS, SingleStream
from conveyor.config import ModelConfig
from conveyor.planner.presets import model_preset

PAD_ID = 0


def hf_model(cfg: ModelConfig, dtype: torch.dtype, device: str) -> Any:
    """A transformers model of this shape with random weights, made on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config}[cfg.architecture]
    config = config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias,
        bos_token_id=cfg.bos_token_id, eos_token_id=None, pad_token_id=PAD_ID)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def generate(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    """Seconds to generate exactly ``new_tokens`` for each prompt, in one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=device)
    _sync(device)
    start = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
    _sync(device)
    return time.perf_counter() - start


def run_workload(model: Any, cfg: ModelConfig, workload: str, num_requests: int | None,
                 batch_size: int, device: str) -> dict[str, Any]:
    base = WORKLOADS[workload]
    requests = replace(base, num_requests=num_requests or base.num_requests
                       ).requests(cfg.vocab_size)
    requests.sort(key=lambda r: r[1].max_tokens)
    asked = sum(params.max_tokens for _, params in requests)
    generated, seconds = 0, 0.0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        new_tokens = max(params.max_tokens for _, params in batch)
        seconds += generate(model, [p for p, _ in batch], new_tokens, device)
        generated += new_tokens * len(batch)
    return {"workload": workload, "num_requests": len(requests), "batch_size": batch_size,
            "duration_s": seconds, "output_tokens": asked, "generated_tokens": generated,
            "output_tokens_per_s": asked / seconds}


def single_stream(model: Any, cfg: ModelConfig, device: str) -> dict[str, Any]:
    stream = SingleStream()
    prompt = [[1000 + i % (cfg.vocab_size - 1000) for i in range(stream.prompt_len)]]
    generate(model, prompt, 2, device)  # warm-up
    ttft = generate(model, prompt, 1, device)
    total = generate(model, prompt, stream.max_tokens, device)
    return {"prompt_len": stream.prompt_len, "output_tokens": stream.max_tokens,
            "ttft_ms": ttft * 1e3,
            "decode_tokens_per_s": (stream.max_tokens - 1) / (total - ttft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a built-in shape (conveyor plan's)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                        help="default: the single stream only")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    cfg = model_preset(args.model)
    model = hf_model(cfg, getattr(torch, args.dtype), args.device)
    report: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "device": args.device,
                              "single_stream": single_stream(model, cfg, args.device)}
    if args.workload:
        report["result"] = run_workload(model, cfg, args.workload, args.num_requests,
                                        args.batch_size, args.device)
    text = json.dumps(report, indent=2)
    print(text)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
