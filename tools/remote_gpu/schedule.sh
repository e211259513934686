# bench_schedule.py on the GPU machine: schedule.sh <bench_schedule.py arguments…> (see bench.sh).
exec bash tools/remote_gpu/bench.sh bench_schedule.py "$@"
