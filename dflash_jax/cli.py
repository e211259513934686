"""Command line: ``dflash-jax demo``, ``generate`` (batch), ``chat`` (interactive), ``train`` and ``calibrate``."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import textwrap

from pathlib import Path

from dflash_jax.decode import verify_modes
from dflash_jax.kernels import IMPLS

DEMO_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "List three tips for staying focused while studying.",
]
DEMO_TIMED_RUNS = 2  # timed runs of each decoding mode (interleaved; the fastest of each is shown)


def _demo(args: argparse.Namespace) -> int:
    from dflash_jax import generate, load_pair, speculative_generate

    print(f"Loading the embedded pair {args.pair!r} ({args.dtype}"
          f"{', ' + args.quantization if args.quantization else ''}) …", flush=True)
    target, drafter = load_pair(args.pair, dtype=args.dtype, draft_vocab=args.draft_vocab,
                                quantization=args.quantization)
    label = "trained" if drafter.trained else "RANDOM, untrained: expect tau ≈ 1"
    print(f"target: {target.name}  |  drafter: {drafter.name} ({label}), "
          f"block size {drafter.config.block_size}", flush=True)
    prompts = args.prompt or DEMO_PROMPTS
    kw = dict(max_new_tokens=args.max_new_tokens, attention_impl=args.attention_impl)

    def run_speculative():
        return speculative_generate(target, drafter, prompts, block_size=args.block_size,
                                    verify_mode=args.verify_mode, **kw)

    # Each program's first run is not timed: it compiles, and on a CPU its first execution also sets up the
    # kernels (about a second more for the speculative program). Then DEMO_TIMED_RUNS runs of each,
    # interleaved, and the table shows each mode's fastest: a small VM's speed drifts by 15–30 % between minutes.
    print("Compiling and warming up both programs (first runs, not timed) …", flush=True)
    first_spec, first_ar = run_speculative(), generate(target, prompts, **kw)
    print(f"Timing {DEMO_TIMED_RUNS} runs of each, interleaved …", flush=True)
    runs = [(run_speculative(), generate(target, prompts, **kw)) for _ in range(DEMO_TIMED_RUNS)]
    spec = max((r[0] for r in runs), key=lambda o: o.stats["tokens_per_s"])
    ar = max((r[1] for r in runs), key=lambda o: o.stats["tokens_per_s"])
    for i, p in enumerate(prompts):
        print(f"\n### Prompt {i + 1}: {p}")
        print(textwrap.indent(spec.texts[i].strip() or "(empty)", "  "))
        same = "identical to autoregressive" if spec.token_ids[i] == ar.token_ids[i] else "DIFFERS from autoregressive"
        mean = sum(spec.acceptance_lengths[i]) / max(len(spec.acceptance_lengths[i]), 1)
        print(f"  [{len(spec.token_ids[i])} tokens, tau {mean:.2f}, {same}]")
    s, a = spec.stats, ar.stats
    print("\n| decoding | tokens | tau | time (s) | tokens/s |\n|---|---|---|---|---|")
    print(f"| autoregressive | {a['new_tokens']} | 1.00 | {a['prefill_s'] + a['decode_s']:.3f} | {a['tokens_per_s']:.1f} |")
    print(f"| DFlash speculative | {s['new_tokens']} | {spec.tau:.2f} | {s['prefill_s'] + s['decode_s']:.3f} | "
          f"{s['tokens_per_s']:.1f} |")
    speedup = s['tokens_per_s'] / a['tokens_per_s']
    print(f"speedup {speedup:.2f}x  (the fastest of {DEMO_TIMED_RUNS} interleaved runs each, after a first run; "
          f"compile time excluded: {first_spec.stats['compile_s']:.1f}s + {first_ar.stats['compile_s']:.1f}s)")
    if speedup < 1.0:  # a newcomer's first run is often on a CPU: say why, from the machine's measured costs
        import jax

        from dflash_jax import costs

        why = costs.resolve(None, jax.default_backend(), drafter.cost_tables).explain(len(prompts))
        if why:
            print(textwrap.fill(why, 110))
    return 0


def _train(args: argparse.Namespace) -> int:
    from dflash_jax.train.pipeline import STAGES, run

    stages = tuple(args.stages.split(",")) if args.stages else STAGES
    result = run(args.config, stages, out_dir=args.out_dir, progress=not args.no_progress,
                 stop_after_s=args.stop_after_s)
    if "data_incomplete" in result:
        d = result["data_incomplete"]
        print(f"data stage stopped (--stop-after-s) with {d['chunks_done']} of {d['chunks_total']} chunks "
              f"({d['rows']} rows) merged into {result['out_dir']}/data.npz; `--stages train` trains on them, and "
              f"running the data stage again generates the rest.")
        return 0
    if "stopped_at" in result:
        print(f"training stopped at step {result['stopped_at']} (--stop-after-s); the weights reached are "
              f"exported to {result['out_dir']}/drafter. Run the same command again to resume.")
        return 0
    ev = result.get("eval") or {}
    for name, r in ev.items():
        if isinstance(r, dict):
            print(f"{name}: tau {r['tau']:.2f} over {r['prompts']} prompts, speculative vs AR {r['speedup']:.2f}x")
    print(f"outputs in {result['out_dir']}")
    return 0


def _load_models(args: argparse.Namespace):
    """(target, drafter or None) from ``--config`` or ``--target/--drafter``, ``--dtype``, ``--quantization``,
    ``--mesh``, ``--autoregressive``."""
    from dflash_jax.loading import load_drafter, load_pair, load_target
    from dflash_jax.sharding import make_mesh, parse_mesh

    mesh = make_mesh(**parse_mesh(args.mesh)) if args.mesh else None
    if args.target and args.draft_vocab:
        raise SystemExit("--draft-vocab takes its token ranking from a pair config (--config); with --target, call "
                         "dflash_jax.restrict_draft_vocab from Python")
    if args.target:
        target = load_target(args.target, args.dtype or "float32", mesh=mesh, quantization=args.quantization)
        drafter = load_drafter(args.drafter, target) if args.drafter else None
    else:
        target, drafter = load_pair(args.config, dtype=args.dtype, mesh=mesh, draft_vocab=args.draft_vocab,
                                    quantization=args.quantization)
    return target, None if args.autoregressive else drafter


def _chat(args: argparse.Namespace) -> int:
    from dflash_jax.chat import run_chat

    print(f"Loading {args.target or args.config} …", flush=True)
    target, drafter = _load_models(args)
    return run_chat(target, drafter, system=args.system, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    block_size=args.block_size, attention_impl=args.attention_impl, verify_mode=args.verify_mode)


def _generate(args: argparse.Namespace) -> int:
    import json

    from dflash_jax.batch import run_batch

    target, drafter = _load_models(args)
    summary = run_batch(target, drafter, args.input, args.output, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, block_size=args.block_size, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed, limit=args.limit, resume=args.resume,
                        skip_bad=args.skip_bad, progress=not args.no_progress,
                        speedup_estimate=not args.no_speedup_estimate, attention_impl=args.attention_impl,
                        verify_mode=args.verify_mode, continuous_batching=args.continuous)
    print(json.dumps({k: v for k, v in summary.items() if k != "acceptance_histogram"}, indent=1))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import jax

    from dflash_jax import costs
    from dflash_jax.engine import calibrate
    from dflash_jax.pairs import find_pair_file

    if args.target and not args.out:
        raise SystemExit("calibrate --target needs --out (the costs file to write; with --config it goes next to "
                         "the pair's YAML)")
    pair_file = None if args.target else find_pair_file(args.config)
    target, drafter = _load_models(args)
    if drafter is None:
        raise SystemExit("calibrate times speculative steps: it needs a drafter (--config, or --target with --drafter)")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"Timing one compact step per tier on {jax.devices()[0].device_kind} ({target.model.dtype}), "
          f"context {args.context}, batches {batches} …", flush=True)
    out = Path(args.out) if args.out else costs.tables_path(pair_file)
    for b in batches:  # each batch's row written as soon as it is timed: an interrupted calibration keeps them
        table = calibrate.measure(target, drafter, batches=(b,), block_size=args.block_size,
                                  context=args.context, repeats=args.repeats,
                                  pair=Path(pair_file).stem if pair_file else Path(args.target).name,
                                  progress=lambda line: print(line, flush=True))
        table = costs.save_table(out, table)  # merged with the rows timed before (same pair, machine, settings)
    key = costs.table_key(costs.load_tables(out), table)  # "gpu", or "gpu@<device>" beside another device's
    slug = re.sub(r"[^\w.@-]+", "_", key)
    png = costs.plot(table, out.with_name(f"{out.name.removesuffix('.json')}.{slug}.png"))
    print(f"wrote the {key} table (batches {', '.join(map(str, sorted(table.step_ms)))}) to {out} and "
          f"its plot to {png}")
    return 0


def _verify_mode_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verify-mode", default="auto", choices=verify_modes.names(),
                        help="auto: compact where the cost table says trimming pays, else static; static: verify "
                             "whole blocks; compact: the confidence scheduler's windows only, packed; "
                             "cap-accept: whole blocks, commit the windows (measures what trimming gives up)")


def _use_compile_cache(args: argparse.Namespace) -> None:
    """Keep compiled XLA programs on disk (``$DFLASH_JAX_CACHE/xla``, default ``~/.cache/dflash_jax/xla``), so
    a later run with the same shapes loads them instead of compiling: the batch command's length buckets, a
    resumed training's steps, the demo. JAX's own ``JAX_COMPILATION_CACHE_DIR`` wins when set. Programs that
    compile in under a second are not kept (JAX's default threshold)."""
    if args.no_compile_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    from dflash_jax.tokenizer import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="smollm2-135m", help="pair name or YAML (default: the embedded pair)")
    parser.add_argument("--target", help="target checkpoint (instead of --config)")
    parser.add_argument("--drafter", help="drafter checkpoint (with --target)")
    parser.add_argument("--autoregressive", action="store_true", help="no drafter: plain decoding")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the pair config's")
    _quantization_option(parser)
    parser.add_argument("--mesh", help="e.g. 'tp=2,dp=4': tensor × data parallel over the local devices")
    _draft_vocab_option(parser)


def _quantization_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", choices=["none", "int8", "fp8"],
                        help="the target's linear layers: none (as the checkpoint stores them), int8 or fp8 "
                             "(weight-only, quantized on load); default: the pair config's")


def _draft_vocab_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-vocab", type=int, metavar="N",
                        help="DFlash drafts over the pair's N most frequent tokens (0: the whole vocabulary; "
                             "default: the pair config's choice for this backend)")


def _rank_tokens(args: argparse.Namespace) -> int:
    from dflash_jax import draft_vocab
    from dflash_jax.loading import load_target
    from dflash_jax.pairs import load_pair_config
    from dflash_jax.train.data import sharegpt_answers

    cfg = load_pair_config(args.config)
    target = load_target(cfg.target, "float32", chat_template_kwargs=cfg.chat_template_kwargs)
    texts = sharegpt_answers(args.conversations)
    ids, counts = draft_vocab.token_ranking(target.tokenizer, texts, progress=not args.no_progress)
    out = draft_vocab.save_ranking(args.out, ids, counts, target.config.vocab_size,
                                   f"ShareGPT answers, first {args.conversations} conversations")
    cover = ", ".join(f"top {n}: {c:.1%}" for n, c in draft_vocab.coverage(out, (4096, 8192, 16384, 32768)).items())
    print(f"wrote {out}: {len(ids)} of {target.config.vocab_size} tokens seen in {int(counts.sum())} "
          f"({cover}).\nUse it from the pair config:  draft_vocab: {{ranking: {out}, size: {{cpu: 16384}}}}")
    return 0


def _sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-jax", description="DFlash speculative decoding in JAX")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-compile-cache", action="store_true",
                        help="do not keep compiled programs in $DFLASH_JAX_CACHE/xla for later runs")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[common],
                          help="run the embedded model pair on a few prompts (speculative vs autoregressive)")
    demo.add_argument("--pair", default="smollm2-135m")
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    _quantization_option(demo)
    demo.add_argument("--max-new-tokens", type=int, default=96)
    demo.add_argument("--block-size", type=int, default=None)
    demo.add_argument("--attention-impl", default="auto", choices=IMPLS,
                      help="auto: the backend's kernels (GPU/TPU), the XLA reference elsewhere")
    demo.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three built-in prompts")
    _draft_vocab_option(demo)
    _verify_mode_option(demo)
    demo.set_defaults(func=_demo)
    train = sub.add_parser("train", parents=[common], help="train a DFlash drafter: data → train → export → eval (resumable)")
    train.add_argument("--config", required=True, help="configs/<pair>.yaml with a 'training' section")
    train.add_argument("--stages", help="comma-separated subset of prompts,data,train,export,eval")
    train.add_argument("--out-dir", help="override training.out_dir")
    train.add_argument("--stop-after-s", type=float,
                       help="stop this call's data generation and training after this many seconds in all "
                            "(finished data chunks and a training checkpoint are kept; the same command "
                            "continues), e.g. to fit time-limited jobs")
    train.add_argument("--no-progress", action="store_true")
    train.set_defaults(func=_train)
    gen = sub.add_parser("generate", parents=[common], help="batch offline generation: JSONL/text prompts in, JSONL out (resumable)")
    _model_options(gen)
    gen.add_argument("--input", required=True, help="JSONL (id + prompt|messages|token_ids) or text, one per line")
    gen.add_argument("--output", required=True, help="JSONL records, appended per finished batch")
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--batch-size", type=int, default=32)
    gen.add_argument("--continuous", action="store_true",
                     help="continuous batching: --batch-size rows, each taking the next prompt when it finishes "
                          "(records written as prompts finish) instead of consecutive batches")
    gen.add_argument("--block-size", type=int)
    _sampling_options(gen)
    gen.add_argument("--limit", type=int, help="only the first N prompts of the input")
    gen.add_argument("--resume", action="store_true", help="continue an existing output, skipping finished ids")
    gen.add_argument("--skip-bad", action="store_true", help="write bad rows to <output>.errors.jsonl and go on")
    gen.add_argument("--no-progress", action="store_true")
    gen.add_argument("--attention-impl", default="auto", choices=IMPLS,
                     help="auto: the backend's kernels (GPU/TPU), the XLA reference elsewhere")
    gen.add_argument("--no-speedup-estimate", action="store_true",
                     help="skip re-running one batch both ways (speculative vs autoregressive) for the summary")
    _verify_mode_option(gen)
    gen.set_defaults(func=_generate)
    chat = sub.add_parser("chat", parents=[common], help="interactive chat with streamed answers (τ and tokens/s "
                                                         "after each)")
    _model_options(chat)
    chat.add_argument("--system", help="a system message at the start of the conversation")
    chat.add_argument("--max-new-tokens", type=int, default=512, help="per answer")
    _sampling_options(chat)
    chat.add_argument("--block-size", type=int)
    chat.add_argument("--attention-impl", default="auto", choices=IMPLS)
    _verify_mode_option(chat)
    chat.set_defaults(func=_chat)
    cal = sub.add_parser("calibrate", parents=[common],
                         help="measure the step cost table the confidence scheduler uses (compact / cap-accept)")
    _model_options(cal)
    cal.add_argument("--batches", default="1,4,16,32,64,128", help="comma-separated batch sizes to time")
    cal.add_argument("--context", type=int, default=256, help="tokens in each row's cache while timing")
    cal.add_argument("--repeats", type=int, default=20,
                     help="per tier, 3 calls of 2·(repeats/3) timed steps and 3 of none; a step costs the slope "
                          "between their medians (a call's own cost left out)")
    cal.add_argument("--block-size", type=int, help="default: the drafter's trained verify width")
    cal.add_argument("--out", help="costs file to write (default: configs/<pair>.costs.json, one table per backend "
                                   "(and per device kind beside it); "
                                   "batches measured before for the same pair and settings are kept)")
    cal.set_defaults(func=_calibrate)
    rank = sub.add_parser("draft-vocab", parents=[common],
                          help="rank the target's tokens by their frequency in ShareGPT answers (a pair's "
                               "draft_vocab.ranking)")
    rank.add_argument("--config", required=True, help="pair name or YAML (its target's tokenizer counts)")
    rank.add_argument("--conversations", type=int, default=6000, help="ShareGPT conversations to count")
    rank.add_argument("--out", required=True, help="ranking file to write (.npz)")
    rank.add_argument("--no-progress", action="store_true")
    rank.set_defaults(func=_rank_tokens)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _use_compile_cache(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
