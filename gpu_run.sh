#!/bin/bash
# one device call: the GPU tests touched by the change, then the FLUX.1-dev step benchmark
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout ${T_FAST:-200} python -m pytest -q -n 6 -m "not full_size" $FAST_TESTS -p no:cacheprovider > $OUT/fast.log 2>&1; echo "fast rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/fast.log; grep -E "^FAILED|^ERROR" $OUT/fast.log | head -20
timeout ${T_FULL:-220} python -m pytest -q $FULL_TESTS -p no:cacheprovider > $OUT/full.log 2>&1; echo "full rc=$? $(( $(date +%s)-T0 ))s"; tail -3 $OUT/full.log; grep -E "^FAILED|^ERROR" $OUT/full.log | head -20
if [ -n "$BENCH" ]; then timeout ${T_BENCH:-160} python -m diffusers_fastpath.bench $BENCH --json $OUT/bench.json --markdown $OUT/bench.md --no-progress > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s)-T0 ))s"; grep "^|" $OUT/bench.log | head -60; fi
