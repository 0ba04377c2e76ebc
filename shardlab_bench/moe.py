"""Time the MoE block's expert computation against a per-expert loop, and measure how far DeepSeek-V3's bias-based
balancing brings a collapsed router back toward even load; write one JSON.

    python -m shardlab_bench moe --shapes tiny,small --threads 1 --repeats 15 --out bench_moe.json

Experts. Each candidate runs the routed experts of one MoE layer (8 experts, top 2, SwiGLU) forward and backward on
the same tokens, routing and weights, the candidates taking turns repeat by repeat so that load from other processes
hits them alike; the JSON gives median and min ms, each candidate's largest output difference from the baseline, and
each median's speed-up over it. Candidates:
- ``per_expert_loop`` (the baseline): transformers 5's eager experts (``MixtralExperts.forward``): a one-hot mask of
  the choices, then for each expert hit a ``torch.where`` for its tokens, a gather, the SwiGLU, an ``index_add_``.
- ``grouped_mm`` and ``sorted_loop``: shardlab_tasks/lm/models/moe_experts.py (``GroupedExperts`` with experts_impl
grouped_mm
  or loop), the dispatch (sort by expert, one gather, one ``index_add_``) included in the time.
- ``padded_bmm``: each expert's rows padded to the largest group, one ``torch.bmm`` per projection.

Balancing. The toy of tests/unit/test_moe_block.py at a larger batch: a router whose logits lean toward experts 0
and 1 for every token sends nearly all of them there (max/mean load = num_experts / top_k = 4 = total collapse);
with ``bias_update_rate`` > 0, ``MoEBlock.update_score_bias`` runs after each batch. The JSON gives max/mean over the
last quarter of the steps (mean and worst) for the plain router and each rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardlab_bench.provenance import collect, finish
from shardlab_tasks.lm.models.moe import MoEBlock, family_config, load_summary
from shardlab_tasks.lm.models.moe_experts import GroupedExperts, dispatch

SHAPES = {  # name -> (dim, expert ffn, tokens per batch)
    "tiny": (64, 128, 512),  # the scale of a 2-core CPU config
    "small": (256, 512, 2048),
    "medium": (512, 1024, 2048),
}
NUM_EXPERTS, TOP_K = 8, 2
CANDIDATES = ("per_expert_loop", "grouped_mm", "sorted_loop", "padded_bmm")


def per_expert_loop(x, indices, weights, gate_up, down) -> torch.Tensor:
    """transformers 5's eager experts (MixtralExperts.forward), re-typed here so the tool needs no transformers."""
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(indices, num_classes=NUM_EXPERTS + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit:
        expert = expert[0]
        choice, token = torch.where(mask[expert])
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[token, choice, None]
        out.index_add_(0, token, y)
    return out


def padded_bmm(x, indices, weights, gate_up, down) -> torch.Tensor:
    """Sort as GroupedExperts does, pad every group to the largest, two bmm, unpad."""
    route = dispatch(indices, weights, NUM_EXPERTS, None)
    counts = route.counts
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    expert_of = torch.repeat_interleave(torch.arange(NUM_EXPERTS), counts)
    slot = torch.arange(route.token.numel()) - starts[expert_of]
    padded = x.new_zeros(NUM_EXPERTS, width, x.shape[1]).index_put((expert_of, slot), x[route.token])
    gate, up = torch.bmm(padded, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))[expert_of, slot] * route.weight.unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, route.token, y)


def make_case(dim: int, ffn: int, tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator)
    logits = torch.randn(tokens, NUM_EXPERTS, generator=generator)
    weights, indices = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    experts = {impl: GroupedExperts(NUM_EXPERTS, dim, ffn, impl) for impl in ("grouped_mm", "loop")}
    gate_up = torch.randn(NUM_EXPERTS, 2 * ffn, dim, generator=generator) * dim**-0.5
    down = torch.randn(NUM_EXPERTS, dim, ffn, generator=generator) * ffn**-0.5
    with torch.no_grad():
        for module in experts.values():
            module.gate_up_proj.copy_(gate_up)
            module.down_proj.copy_(down)
    return x, indices, weights / weights.sum(-1, keepdim=True), experts


def candidate_step(name: str, case):
    """One forward + backward of candidate ``name``; returns the forward output (detached)."""
    x, indices, weights, experts = case
    module = experts["loop" if name == "sorted_loop" else "grouped_mm"]
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    if name in ("grouped_mm", "sorted_loop"):
        out = module(x, dispatch(indices, weights, NUM_EXPERTS, None))
    else:
        fn = per_expert_loop if name == "per_expert_loop" else padded_bmm
        out = fn(x, indices, weights, module.gate_up_proj, module.down_proj)
    out.square().mean().backward()
    return out.detach()


def bench_shape(shape: str, repeats: int, warmup: int) -> dict:
    case = make_case(*SHAPES[shape])
    reference = candidate_step("per_expert_loop", case)
    result: dict[str, dict] = {}
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    for name in CANDIDATES:
        result[name] = {"max_abs_diff_vs_per_expert_loop": float((candidate_step(name, case) - reference).abs().max())}
        for _ in range(warmup):
            candidate_step(name, case)
    for _ in range(repeats):  # interleaved: each repeat runs every candidate once
        for name in CANDIDATES:
            start = time.perf_counter()
            candidate_step(name, case)
            times[name].append(1000 * (time.perf_counter() - start))
    baseline = statistics.median(times["per_expert_loop"])
    for name in CANDIDATES:
        median = statistics.median(times[name])
        result[name] |= {
            "median_ms": round(median, 3),
            "min_ms": round(min(times[name]), 3),
            "speedup_vs_per_expert_loop": round(baseline / median, 3),
        }
    return result


def balancing_run(rate: float | None, steps: int, tokens: int, seed: int = 0) -> list[float]:
    """max/mean load per step of the collapse toy; rate None = the plain router (no score bias)."""
    dim = 32
    sizes = dict(num_experts=NUM_EXPERTS, top_k=TOP_K, ffn_dim=8)
    cfg = family_config("deepseek_v3", **sizes, score_bias=rate is not None, bias_update_rate=rate or 0.0)
    block = MoEBlock(cfg, dim)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        block.router.weight[:2] += 1.0
    history = []
    for _ in range(steps):
        x = torch.randn(tokens, dim, generator=generator) * 0.5 + 1.0
        with torch.no_grad():
            _, stats = block(x)
        history.append(load_summary(stats.tokens_per_expert)["max_over_mean"])
        block.update_score_bias(stats.tokens_per_expert)
    return history


def bench_balancing(rates: list[float], steps: int, tokens: int) -> dict:
    out = {}
    for rate in [None, *rates]:
        tail = balancing_run(rate, steps, tokens)[-max(1, steps // 4) :]
        key = "plain_router" if rate is None else f"bias_rate_{rate:g}"
        out[key] = {"max_over_mean_last_quarter_mean": round(statistics.mean(tail), 3), "worst": round(max(tail), 3)}
        print(f"  balancing {key:18s} max/mean {out[key]['max_over_mean_last_quarter_mean']:.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,small", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--balance-rates", default="0.001,0.01", help="bias_update_rate values of the balancing toy")
    parser.add_argument("--balance-steps", type=int, default=400)
    parser.add_argument("--balance-tokens", type=int, default=4096)
    parser.add_argument("--out", default="bench_moe.json")
    args = parser.parse_args(argv)
    meta = collect(__file__, argv, settings=vars(args))
    results: dict = {"num_experts": NUM_EXPERTS, "top_k": TOP_K, "shapes": {}, "experts": {}}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for shape in args.shapes.split(","):
            dim, ffn, tokens = SHAPES[shape]
            results["shapes"][shape] = {"dim": dim, "expert_ffn": ffn, "tokens": tokens}
            entry = bench_shape(shape, args.repeats, args.warmup)
            results["experts"][f"{shape}_threads{threads}"] = entry
            line = ", ".join(
                f"{n} {entry[n]['median_ms']:.1f} ms (x{entry[n]['speedup_vs_per_expert_loop']})" for n in CANDIDATES
            )
            print(f"{shape} ({dim}/{ffn}/{tokens} tokens), {threads} thread(s): {line}", flush=True)
    rates = [float(r) for r in args.balance_rates.split(",") if r]
    results["balancing"] = bench_balancing(rates, args.balance_steps, args.balance_tokens)
    results["meta"] = finish(meta)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return results
