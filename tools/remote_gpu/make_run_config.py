"""Write runs/device/: the training config for the GPU machine (configs/smollm2-135m.yaml pointed at the
device's paths, warm-started from the shipped drafter) and the held-out prompt files (the evaluation sets as
posed to the model, and both together with ids for the batch command)."""

import argparse
import json
from pathlib import Path

import yaml

from dflash_jax.train import data as data_mod

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--data-seed", type=int, default=0,
                help="training.data.seed: another value samples other answers (and another chunk order)")
ap.add_argument("--kind", choices=("dflash", "dspark", "dflash2"), default="dflash",
                help="dspark: a DSpark drafter (γ = 15 drafts, verify width 16) on the shipped DFlash drafter's trunk; "
                     "dflash2: configs/smollm2-135m-dflash2.yaml's DFlash2 drafter, warm-started from the shipped DFlash one")
ap.add_argument("--markov-rank", type=int, default=64,
                help="DSpark's Markov head rank r (2 × 49,152 × r weights: 12.6 MB in bf16 at 64, 50 MB at 256)")
ap.add_argument("--synth-prompts", type=int, default=8000,
                help="self-synthesised instructions the target writes on the device (prompts stage)")
ap.add_argument("--block-widths", default=None,
                help="training.optim.block_widths, comma-separated (DFlash / DFlash2: each anchor's block trained at a "
                     "width drawn from these, e.g. 4,8,16,16; the run's out_dir and name get a -mixed suffix)")
ap.add_argument("--selector-teacher", type=float, default=None,
                help="DFlash2: training.optim.selector_teacher λ (the target's distribution over the K candidates in "
                     "the selector's loss; run 1 trained with 0)")
ap.add_argument("--init-from", default=None,
                help="training.drafter.init_from (default: the shipped DFlash drafter; DFlash2 run 2 may continue "
                     "from dflash_jax/assets/smollm2-135m-dflash2)")
args = ap.parse_args()
out = Path("runs/device")
out.mkdir(parents=True, exist_ok=True)
base = "configs/smollm2-135m-dflash2.yaml" if args.kind == "dflash2" else "configs/smollm2-135m.yaml"
cfg = yaml.safe_load(Path(base).read_text())
cfg["target"] = "/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf"
t = cfg["training"]
t["out_dir"] = "/tmp/run"
t["drafter"]["init_from"] = args.init_from or "dflash_jax/assets/smollm2-135m-dflash"
for key in ("later_turns_min_chars", "code_prompts", "code_packages"):  # the prompts were made locally
    t["data"].pop(key)
t["data"].update(prompts_file="/tmp/prompts.jsonl", num_prompts=100000, generate_batch_size=512, chunk_batches=2,
                 seed=args.data_seed, synth_prompts=args.synth_prompts)
t["optim"].update(lr=3.0e-4, warmup_frac=0.02, epochs=3, val_rows=256, val_every=100000)
t["eval"]["sets"] = [str(out / f"{name}.jsonl") for name in data_mod.EVALUATION_SETS]
name = "smollm2-135m"
if args.kind == "dspark":
    t["drafter"].update(kind="dspark", block_size=15, markov_rank=args.markov_rank)
    t["out_dir"] = "/tmp/run_dspark"
    name = "smollm2-135m-dspark"
if args.kind == "dflash2":  # the recipe's drafter section as it is (kind, block 16, selector and convolutions)
    t["out_dir"] = "/tmp/run_dflash2"
    name = "smollm2-135m-dflash2"
if args.selector_teacher is not None:
    t["optim"]["selector_teacher"] = args.selector_teacher
if args.block_widths:
    t["optim"]["block_widths"] = [int(w) for w in args.block_widths.split(",")]
    t["out_dir"] += "_mixed"
    name += "-mixed"
(out / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
sets = data_mod.evaluation_prompts()
for name, prompts in sets.items():
    (out / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
rows = [{"id": f"{name}-{i}", "prompt": p} for name, prompts in sets.items() for i, p in enumerate(prompts)]
(out / "batch_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
print({name: len(p) for name, p in sets.items()}, "→", out)
