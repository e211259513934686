# bench_schedule.py on the GPU machine: schedule.sh <bench_schedule.py arguments…> (see bench.sh).
exec bash benchmarks/device_runs/bench.sh bench_schedule.py "$@"
