# Benchmarks on random weights of real shapes (no GGUF, no calls 1–2): carry `.whl`. The sweeps schedule with
# `tools/remote_gpu/h100_8b_tables.json` (the H100 tables of the 8B shape at 1 / 16 / 32 / 64 / 128 rows; on
# another GPU type drop it and let each batch be timed). Each phase fits one call; everything lands in $OUT. Usage: bash tools/remote_gpu/shaped.sh <phase>
#   kinds   DFlash vs DFlash2 cycle at batch 1: lax.top_k, the chunked top-K, the head + top-K kernel (issue 57 item 4; ~4 min)
#   kinds64 DFlash vs DFlash2 at 64 rows, the fused head + top-K at any row count (8B and SmolLM2 shapes; ~8 min)
#   qnext   the 8B quantized step with the defaults (XLA's fusion on GPUs): int8, fp8, fp8 blocks at 1 / 16 / 64 rows
#   qmoe    the same for the Qwen3-30B-A3B shape: int8, bf16 at 1 / 16 rows (95 % of the GPU's memory to JAX)
#   topk    the LM head + top-K at 16 rows (Qwen3's and SmolLM2's vocabularies): lax.top_k, chunked, the fused kernel (~2 min)
#   p02     8B shape, p = 0.2, auto and static at 64, 16, 128, 32 rows (tables: tools/remote_gpu/h100_8b_tables.json;
#           each batch's JSON written as it ends) (~8 min)
#   short   little budget left: the embedded pair's DFlash vs DFlash2 at 1 / 64 rows (every top-K form, the fused kernel
#           at any rows), then p02 at 64 and 16 rows for what time is left (${P02_S:-330} s)
#   recheck session 42's changes on the 8B shape: auto at 128 rows p = 0.2 (the slowest row's luck in the policy) and
#           at 64 rows p = 0.3 (its segment log), then block-scaled fp8 at 16 / 64 rows (the scaled-kernel
#           reference) (~8 min)
#   p03     8B shape, p = 0.3, at 64 and 16 rows with the same tables (~5 min)
#   qblocked block-scaled fp8 through the GPU kernel up to 64 tokens (quant_kernel_blocked_max_tokens) at 1 / 16 / 64
#           rows, against XLA's partial products (session 43: 4.735 / 6.559 / 16.490 ms) (~4 min)
#   next    session 43's leftovers: auto at 128 rows p = 0.2 / 0.3 after the cold-probe rule (their logs name each
#           drafted segment's tiers), then block fp8 at 16 / 64 rows through XLA's scaled activations (~8 min)
#   tiers   does a tier's first run in the process cost a probe its 92 ms (session 43)? bench_switch_cost.py at 128
#           rows p = 0.2, the untimed first call timed too, with each segment's tiers first run; again with CUDA's
#           lazy loading off and with the tier switch as a graph node (~8 min)
#   qtau1   the int8 8B shape at τ = 1 (p = 1) and p = 0.3, static and auto at 1 / 16 rows (\${QTAU1_Q}) (~9 min)
#   graphs  the tiers phase's first call with XLA's command buffers (CUDA graphs) off, then on (~6 min)
#   qdefault block fp8 at 1 / 16 / 64 rows with the defaults (the GPU kernel from 3 to 64 tokens) (~4 min)
#   qmoesorted the MoE shape's block-fp8 AR step and cycle at 16 rows, quantized experts past E pairs through the
#           sorted kernels against the default (every expert a few at a time; H200: the bf16 stack fits) (~8 min)
#   qab     the block-fp8 default against XLA's scaled activations at 16 / 64 rows on one card (~6 min)
#   p02big  8B shape, p = 0.2, static and auto at 64 and 256 rows (\${P02_B}, \${P02_S}) (~9 min)
#   moesweep the MoE shape (bf16), p = 0.3 and 0.2, static and auto at \${MOE_B} rows (default 16) (~8 min a batch?)
#   qacts   next's second half alone: block fp8 at 16 / 64 rows through XLA's scaled activations (~3 min)
#   qgroup  the quantized kernels' GPU tests, then the 8B int8 AR step and cycle at 1 / 16 rows with q / k / v and
#           gate / up each in one launch (quant_group_kernel) against one launch a layer (issue 56) (~6 min)
#   one     when one call is all the session may get: the grouped kernel's GPU tests, the int8 AR step at batch 1
#           without / with it, then kinds (~8 min)
#   mini    the first half of one (~5 min)
#   pick    little budget left: kinds first (DFlash2's three top-K forms), then micro's two AR steps without the test (~7 min)
#   micro   the grouped kernel's GPU test and the int8 AR step at batch 1 without / with it (~4 min)
#   qsweep1 the int8 matmul alone at T = 1 over every block choice (issue 56: the AR step's kernel) (~4 min?)
#   qsweep  the quantized matmul alone at the 8B layers (issue 56; int8 block choices) (~8 min?)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TF_CPP_MIN_LOG_LEVEL=2 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
# the H100's tables schedule an H100 only; another GPU times each batch's table itself (slower)
case "$GPU" in *H100*) TABLES="--cost-table tools/remote_gpu/h100_8b_tables.json"; B02=64,16,128,32 ;;
  *) TABLES=""; B02=64,16 ;; esac
case "$1" in
  kinds) timeout 560 python3 benchmarks/bench_drafter_kinds.py --shape 8b --batches 1 --kinds dflash,dflash2 \
           --top-k-impl all --out $OUT/kinds_8b_b1.json 2>&1 | tail -n 12 ;;
  kinds64) timeout 330 python3 benchmarks/bench_drafter_kinds.py --shape 8b --batches 64 --kinds dflash,dflash2 \
             --top-k-impl all --fused-max-rows 0 --out $OUT/kinds_8b_b64.json 2>&1 | tail -n 5
           timeout 200 python3 benchmarks/bench_drafter_kinds.py --shape smollm2 --batches 64 --kinds dflash,dflash2 \
             --top-k-impl all --fused-max-rows 0 --out $OUT/kinds_smollm2_b64.json 2>&1 | tail -n 5 ;;
  qnext) timeout 400 python3 benchmarks/bench_quantized_step.py --quantizations int8,fp8,fp8-block --batches 1,16,64 \
           --out $OUT/qstep_8b_default.json 2>&1 | tail -n 8  # 385 s in session 42; its JSON grows per scheme
         timeout 180 python3 benchmarks/bench_quantized_step.py --quantizations int8 --batches 1 --drafter-quantization \
           --out $OUT/qstep_8b_int8_drafter_int8.json 2>&1 | tail -n 3 ;;
  qmoe) # JAX takes 75 % of a GPU's memory by default: the bf16 experts alone are 61 GB (session 42 ran out of memory)
        for q in ${QMOE:-int8 bf16}; do XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${QMOE_S:-270} python3 benchmarks/bench_quantized_step.py \
          --shape moe --quantizations $q --batches 1,16 --out $OUT/qstep_moe_$q.json 2>&1 | tail -n 4; done ;;
  topk) timeout 300 python3 benchmarks/bench_top_k.py --rows 16 --vocabs 151936,49152 --dtypes bfloat16 --chunks 8192 \
          --out $OUT/top_k.json 2>&1 | grep -E "^head" | tail -n 12 ;;
  p02) timeout 570 python3 benchmarks/bench_compact_scaled.py --batches $B02 --corrupt 0.2 --modes static,auto \
         --repeats 2 $TABLES --out $OUT/p02.json --plot $OUT/p02.png 2>&1 | grep -v "^  [^(]" | tail -n 20 ;;
  short) timeout 200 python3 benchmarks/bench_drafter_kinds.py --shape smollm2 --batches 1,64 --kinds dflash,dflash2 \
           --top-k-impl all --fused-max-rows 0 --out $OUT/kinds_smollm2_b1_b64.json 2>&1 | tail -n 8
         timeout ${P02_S:-330} python3 benchmarks/bench_compact_scaled.py --batches 64,16 --corrupt 0.2 --modes static,auto \
           --repeats 2 $TABLES --out $OUT/p02.json --plot $OUT/p02.png 2>&1 | grep -v "^  [^(]" | tail -n 12 ;;
  recheck) timeout 200 python3 benchmarks/bench_compact_scaled.py --batches 128 --corrupt 0.2 --modes auto --repeats 2 \
             $TABLES --out $OUT/p02_b128.json 2>&1 | grep -v "^  [^(]" | tail -n 4
           timeout 180 python3 benchmarks/bench_compact_scaled.py --batches 64 --corrupt 0.3 --modes auto --repeats 2 \
             $TABLES --out $OUT/p03_b64.json 2>&1 | grep -v "^  [^(]" | tail -n 4
           timeout 170 python3 benchmarks/bench_quantized_step.py --quantizations fp8-block --batches 16,64 \
             --out $OUT/qstep_8b_fp8_block.json 2>&1 | tail -n 4 ;;
  qblocked) timeout 250 python3 benchmarks/bench_quantized_step.py --quantizations fp8-block --batches 1,16,64 \
              --quant-kernel blocked --out $OUT/qstep_8b_fp8_block_kernel.json 2>&1 | tail -n 5 ;;
  qdefault) timeout 250 python3 benchmarks/bench_quantized_step.py --quantizations fp8-block --batches 1,16,64 \
              --out $OUT/qstep_8b_fp8_block_default.json 2>&1 | tail -n 5 ;;
  qmoesorted) # the MoE shape's block-fp8 verify through the sorted kernels (moe_quantized_sorted) against the default
        for k in moe-sorted default; do XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 270 python3 \
          benchmarks/bench_quantized_step.py --shape moe --quantizations fp8-block --batches 16 --quant-kernel $k \
          --out $OUT/qstep_moe_fp8_block_$k.json 2>&1 | tail -n 3; done ;;
  qab) # the block-fp8 default's A/B on one card: the GPU kernel (3–64 tokens) against XLA's scaled activations
       for k in default xla-blocked; do timeout 200 python3 benchmarks/bench_quantized_step.py --quantizations fp8-block \
         --batches 16,64 --quant-kernel $k --out $OUT/qstep_8b_fp8_block_$k.json 2>&1 | tail -n 3; done ;;
  p02big) # p = 0.2 at 64 rows (the H100's table) and 256 rows (timed here), auto and static
       timeout ${P02_S:-560} python3 benchmarks/bench_compact_scaled.py --batches ${P02_B:-64,256} --corrupt 0.2 \
         --modes static,auto --repeats 2 $TABLES --out $OUT/p02big.json --plot $OUT/p02big.png 2>&1 | grep -v "^  [^(]" | tail -n 16 ;;
  moesweep) # the Qwen3-30B-A3B shape in bf16 (H200: 95 % of its memory to JAX), p = 0.3 and 0.2 sharing each batch's
       # AR reference and table; each batch's JSONs written as it ends (one batch ≈ one call)
       XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout ${MOE_S:-570} python3 benchmarks/bench_compact_scaled.py --shape moe \
         --batches ${MOE_B:-16} --corrupt 0.3,0.2 --modes static,auto --repeats 2 --out $OUT/moe_b${MOE_B:-16}.json \
         --plot $OUT/moe_b${MOE_B:-16}.png 2>&1 | grep -v "^  [^(]" | tail -n 16 ;;
  qacts) timeout 170 python3 benchmarks/bench_quantized_step.py --quantizations fp8-block --batches 16,64 \
          --out $OUT/qstep_8b_fp8_block_acts.json 2>&1 | tail -n 4 ;;
  next) for p in 0.2 0.3; do timeout 160 python3 benchmarks/bench_compact_scaled.py --batches 128 --corrupt $p --modes auto \
          --repeats 2 $TABLES --out $OUT/p${p#0.}_b128.json 2>&1 | grep -v "^  [^(]" | tail -n 4; done
        bash "$0" qacts ;;
  tiers) # (the H100's tables on any GPU: the question is a first run's cost, not the schedule's)
         H100T="--cost-table tools/remote_gpu/h100_8b_tables.json"
         # p = 0.2 as XLA runs it, then with CUDA's lazy loading off (a kernel's first launch loads it: a tier never
         # run has hundreds), then with the tier switch as a conditional node (each branch a child of one graph)
         timeout 200 python3 benchmarks/bench_switch_cost.py --batch 128 --corrupt 0.2 $H100T \
           --out $OUT/switch_tiers_b128.json 2>&1 | tail -n 28
         CUDA_MODULE_LOADING=EAGER timeout 170 python3 benchmarks/bench_switch_cost.py --batch 128 --corrupt 0.2 $H100T \
           --out $OUT/switch_tiers_b128_eager.json 2>&1 | grep -A14 "first call"
         timeout 170 python3 benchmarks/bench_switch_cost.py --batch 128 --corrupt 0.2 --host-tier-switch off \
           $H100T --out $OUT/switch_tiers_b128_node.json 2>&1 | grep -A14 "first call" ;;
  qtau1) # issue 56's cycle at τ = 1 as users get it: the int8 8B shape, auto (and static) at p = 1 (every draft
        # wrong) and p = 0.3, 1 and 16 rows, each batch's table timed in the run
        timeout ${QTAU1_S:-560} python3 benchmarks/bench_compact_scaled.py --quantization ${QTAU1_Q:-int8} --batches 1,16 \
          --corrupt 1.0,0.3 --modes static,auto --repeats 3 --out $OUT/qtau1.json 2>&1 | grep -v "^  [^(]" | tail -n 16 ;;
  graphs) # is the drafted program's first run after the fallback's (79 ms for a 27 ms step, session 44) CUDA graphs
         # being recorded and instantiated? the tiers phase's first call with XLA's command buffers off, then on
         H100T="--cost-table tools/remote_gpu/h100_8b_tables.json"
         XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout 200 python3 benchmarks/bench_switch_cost.py \
           --batch 128 --corrupt 0.2 $H100T --out $OUT/switch_tiers_b128_no_graphs.json 2>&1 | grep -A14 "first call"
         timeout 200 python3 benchmarks/bench_switch_cost.py --batch 128 --corrupt 0.2 $H100T \
           --out $OUT/switch_tiers_b128.json 2>&1 | grep -A14 "first call" ;;
  p03) timeout 570 python3 benchmarks/bench_compact_scaled.py --batches 64,16 --corrupt 0.3 --modes static,auto \
         --repeats 2 $TABLES --out $OUT/p03.json --plot $OUT/p03.png 2>&1 | grep -v "^  [^(]" | tail -n 20 ;;
  qgroup) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quantized_kernels.py 2>&1 | tail -n 4
          for k in on grouped; do timeout 170 python3 benchmarks/bench_quantized_step.py --quantizations int8 \
            --batches 1,16 --quant-kernel $k --out $OUT/qstep_int8_$k.json 2>&1 | tail -n 4; done ;;
  one|mini) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quantized_kernels.py -k "grouped or together" \
         2>&1 | tail -n 3
       for k in on grouped; do timeout 130 python3 benchmarks/bench_quantized_step.py --quantizations int8 --batches 1 \
         --quant-kernel $k --profile --out $OUT/qstep_int8_b1_$k.json 2>&1 | tee $OUT/qstep_b1_$k.log | tail -n 2; done
       [ "$1" = mini ] || timeout 230 python3 benchmarks/bench_drafter_kinds.py --shape 8b --batches 1 --kinds dflash,dflash2 \
         --top-k-impl all --out $OUT/kinds_8b_b1.json 2>&1 | tail -n 12 ;;
  pick) timeout 240 python3 benchmarks/bench_drafter_kinds.py --shape 8b --batches 1 --kinds dflash,dflash2 \
          --top-k-impl all --out $OUT/kinds_8b_b1.json 2>&1 | tail -n 6
        for k in on grouped; do timeout 85 python3 benchmarks/bench_quantized_step.py --quantizations int8 --batches 1 \
          --steps 10 --repeats 3 --quant-kernel $k --profile --out $OUT/qstep_int8_b1_$k.json 2>&1 | tee $OUT/qstep_b1_$k.log | tail -n 1; done ;;
  micro) timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_quantized_kernels.py -k "8b_grouped" 2>&1 | tail -n 2
         for k in on grouped; do timeout 85 python3 benchmarks/bench_quantized_step.py --quantizations int8 --batches 1 \
           --steps 10 --repeats 3 --quant-kernel $k --profile --out $OUT/qstep_int8_b1_$k.json 2>&1 | tee $OUT/qstep_b1_$k.log | tail -n 1; done ;;
  qsweep1) timeout 570 python3 benchmarks/bench_quantized_step.py --sweep --sweep-tokens 1 --sweep-schemes int8 \
            --repeats 3 --out $OUT/qsweep1.json 2>&1 | tail -n 80 ;;
  qsweep) timeout 570 python3 benchmarks/bench_quantized_step.py --sweep --out $OUT/qsweep.json 2>&1 | tail -n 40 ;;
  *) echo "usage: $0 recheck|short|kinds|kinds64|qnext|qdefault|qmoesorted|qab|p02big|moesweep|graphs|qtau1|qacts|qblocked|qmoe|pick|topk|p02|p03|qgroup|one|mini|micro|qsweep1|qsweep" >&2; exit 2 ;;
esac
