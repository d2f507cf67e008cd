#!/usr/bin/env bash
# The Fashion-MNIST reproduction (docs/reproduce.md, docs/results.md): every table of it, one `fedrod-ray reproduce` after
# another, in priority order. Run it from a clone of fedrod-ray at a fixed commit, with OUT outside any
# work tree; run it again, with the same OUT, to continue: a table already in OUT is resumed (--resume),
# a finished one only rewrites its results. A job that another run of this script is running now stops at
# once (its log names the process that holds it) and the queue goes on to the next.
#
#   FEDROD_DATA_DIR=/path/to/data bash deploy/reproduce_fmnist.sh OUT [JOB ...]
#
# JOB: main_a0.3 new_clients main_a0.1 init_a0.3 seeds_a0.3 normalize_a0.3 momentum_a0.3 (default: all, in
# that order), or meta_bsm_a0.3 / meta_bsm_a0.1 (the main tables' Meta-BSM row alone); the personalized-FL
# baselines: the sweeps that select their parameters (sweep_lambda, sweep_perfedavg, sweep_pfedme: tune/pfl_*.yaml),
# the rows without such a parameter (pfl_a0.3, pfl_a0.1), local-only with those whose parameter sweep_lambda
# chose (pfl_tuned_a0.3, pfl_tuned_a0.1), Per-FedAvg and pFedMe once their sweeps chose (pfl_plain_a0.3,
# pfl_plain_a0.1), and more seeds at Dir(0.1): seed 1 (seeds_a0.1) and seed 3 (seed3_a0.1); one
# personalized-FL row alone, as a table of its own (<row>_a0.3, <row>_a0.1 with <row> one of PFL_ROWS'
# keys, e.g. ditto_a0.3): a row finished that way is kept by its published files whatever becomes of the
# others; client-level DP's privacy-utility table on
# configs/fmnist_dp.yaml (privacy: 1,000 clients, docs/privacy.md), or its pair at one epsilon alone
# (privacy_epsinf, privacy_eps8, privacy_eps4, privacy_eps1). The methods built for new clients, each row a
# job of its own: FedBABU's sweep of its fine-tuning epochs (fedbabu_sweep: tune/pfl_fedbabu.yaml, seed 1),
# then, with the value it chose in tune/tables.py, its main-table rows (fedbabu_a0.3, fedbabu_a0.1) and its
# new-clients row (fedbabu_new_clients); pFedHN's and PeFLL's sweeps of their server learning rate and embedding
# size (pfedhn_sweep, pefll_sweep: tune/pfl_pfedhn.yaml, tune/pfl_pefll.yaml, seed 1), then their main-table
# rows (pfedhn_a0.3, pfedhn_a0.1, pefll_a0.3, pefll_a0.1) and new-clients rows (pfedhn_new_clients,
# pefll_new_clients).
set -uo pipefail
out=${1:?usage: reproduce_fmnist.sh OUT [JOB ...]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)

base=configs/fmnist_paper.yaml
main_rows=(--row FedAvg --row FedProx --row SCAFFOLD --row FedDyn --row "Fed-RoD (linear)"
           --row "Fed-RoD (hyper)" --row "Fed-RoD (hyper) + FedDyn" --row "Fed-RoD (Meta-BSM)")
two_rows=(--row FedAvg --row "Fed-RoD (hyper)")
pfl_rows=(--row LG-FedAvg --row FedPer --row FedFOMO --row FedRep)
pfl_tuned_rows=(--row local-only --row MTL --row Ditto)
pfl_plain_rows=(--row Per-FedAvg --row pFedMe)
# Dir(0.1)'s rows run with more seeds: the generic rows the gains are largest against, Fed-RoD, and the best
# personalized-FL row (env BEST_PFL).
seed_rows=(--row FedAvg --row FedDyn --row "Fed-RoD (hyper)" ${BEST_PFL:+--row "$BEST_PFL"})
# The personalized-FL rows by their method's name (train.head; local: the local-only rule).
declare -A PFL_ROWS=([mtl]=MTL [lg_fedavg]=LG-FedAvg [fedper]=FedPer [perfedavg]=Per-FedAvg [pfedme]=pFedMe
                     [ditto]=Ditto [fedfomo]=FedFOMO [fedrep]=FedRep [local]=local-only [fedbabu]=FedBABU
                     [pfedhn]=pFedHN [pefll]=PeFLL)
# The paper's new-client split: 100 clients under Dir(0.3), 50 train, 50 held out, 20 per round.
new_client_split=(--set data.alpha=0.3 --set data.num_clients=50 --set data.new_clients=50
                  --set train.client_fraction=0.4)
new_client_rows=(--row FedAvg --row FedDyn --row "Fed-RoD (linear)" --row "Fed-RoD (hyper)")

job_args() {
  case $1 in
    main_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 "${main_rows[@]}") ;;
    # The main tables' Meta-BSM row alone, as a table of its own (a table comes from one commit): the
    # published main tables ran it before its fix (docs/results.md, "Meta-BSM collapsed"). Not in the default list, which runs
    # the main tables whole.
    meta_bsm_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 --row "Fed-RoD (Meta-BSM)") ;;
    meta_bsm_a0.1) args=(--table main --seeds 0, --row "Fed-RoD (Meta-BSM)") ;;
    # The paper's rows of the new-clients table; the methods built for new clients run theirs alone.
    new_clients) args=(--table new-clients --seeds 0, "${new_client_split[@]}" "${new_client_rows[@]}") ;;
    fedbabu_new_clients | pfedhn_new_clients | pefll_new_clients)
      args=(--table new-clients --seeds 0, "${new_client_split[@]}" --row "${PFL_ROWS[${1%_new_clients}]}") ;;
    main_a0.1) args=(--table main --seeds 0, "${main_rows[@]}") ;;
    # The protocol audit: each switch whose two settings can change a result, at the other setting.
    init_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 --set model.init=pytorch "${two_rows[@]}") ;;
    seeds_a0.3) args=(--table main --seeds 1,2 --set data.alpha=0.3 "${two_rows[@]}") ;;
    normalize_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 --set data.normalize=false "${two_rows[@]}") ;;
    momentum_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 --set train.momentum_buffers=keep
                         "${two_rows[@]}") ;;
    pfl_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 "${pfl_rows[@]}") ;;
    pfl_a0.1) args=(--table main --seeds 0, "${pfl_rows[@]}") ;;
    pfl_tuned_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 "${pfl_tuned_rows[@]}") ;;
    pfl_tuned_a0.1) args=(--table main --seeds 0, "${pfl_tuned_rows[@]}") ;;
    pfl_plain_a0.3) args=(--table main --seeds 0, --set data.alpha=0.3 "${pfl_plain_rows[@]}") ;;
    pfl_plain_a0.1) args=(--table main --seeds 0, "${pfl_plain_rows[@]}") ;;
    # Seed 2's Dir(0.1) split leaves a client without examples, which the paper's split (no minimum:
    # data.min_per_client=0) refuses: seeds_a0.1, published at 516dfff with --seeds 1,2, had its seed-2
    # trials stop as they started; since 0ff3bd7 reproduce refuses that seed before any trial. Seed 3 is the
    # third seed.
    seeds_a0.1) args=(--table main --seeds 1, "${seed_rows[@]}") ;;
    seed3_a0.1) args=(--table main --seeds 3, "${seed_rows[@]}") ;;
    sweep_lambda | sweep_perfedavg | sweep_pfedme) args=(--config "tune/pfl_${1#sweep_}.yaml") ;;
    fedbabu_sweep | pfedhn_sweep | pefll_sweep) args=(--config "tune/pfl_${1%_sweep}.yaml") ;;
    privacy) args=(--table privacy --seeds 0,); job_base=configs/fmnist_dp.yaml ;;
    # The privacy table's two methods at one epsilon (privacy_epsinf: without DP), a table of their own.
    privacy_eps*)
      local eps=${1#privacy_eps}
      [ "$eps" = inf ] && eps=∞
      args=(--table privacy --seeds 0, --row "FedAvg, ε = $eps" --row "Fed-RoD (hyper), ε = $eps")
      job_base=configs/fmnist_dp.yaml ;;
    *_a0.3 | *_a0.1)
      local row=${PFL_ROWS[${1%_a0.?}]:-}
      [ -n "$row" ] || { echo "unknown job $1" >&2; return 2; }
      args=(--table main --seeds 0, --row "$row")
      if [[ $1 == *_a0.3 ]]; then args+=(--set data.alpha=0.3); fi ;;
    *) echo "unknown job $1" >&2; return 2 ;;
  esac
}

jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=(main_a0.3 new_clients main_a0.1 init_a0.3 seeds_a0.3 normalize_a0.3 momentum_a0.3)
# A private Ray per table, under its own temp dir: never one that a test or another run started.
export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/fmnist-repro} RAY_USAGE_STATS_ENABLED=0
mkdir -p "$RAY_TMPDIR"
for job in "${jobs[@]}"; do
  job_base=$base
  job_args "$job" || exit 2
  echo "=== $(date -u +%FT%TZ) $job (commit $(git rev-parse --short HEAD))" | tee -a "$out/$job.log"
  if [[ $job == sweep_* || $job == *_sweep ]]; then
    if [ -d "$out/$job" ]; then
      fedrod-ray tune --resume "$out/$job" >>"$out/$job.log" 2>&1
    else
      fedrod-ray tune "${args[@]}" --sweep-dir "$out/$job" >>"$out/$job.log" 2>&1
    fi
  elif [ -f "$out/$job/reproduce.yaml" ] && [ -d "$out/$job/trials" ]; then
    fedrod-ray reproduce --resume "$out/$job" >>"$out/$job.log" 2>&1
  else
    fedrod-ray reproduce --config "$job_base" "${args[@]}" --out "$out/$job" >>"$out/$job.log" 2>&1
  fi
  rc=$?  # before the line below, whose $(date) would set $? to its own
  echo "=== $(date -u +%FT%TZ) $job exit $rc" | tee -a "$out/$job.log"
done
